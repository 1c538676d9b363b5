"""A real `hybridlb serve` process tree per test module, driven over real HTTP."""

from __future__ import annotations

import pytest

from hybridlb.testing.servers import start_server


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    server = start_server(tiny_qwen3)
    yield server
    assert server.stop() == 0
