"""One real-model `hybridlb serve` per session (SmolLM2-135M-Instruct from its GGUF file)."""

from __future__ import annotations

import pytest

from tests.conftest import SMOLLM2
from tests.servers import start_server


@pytest.fixture(scope="session")
def smollm2_server():
    server = start_server(SMOLLM2, "--served-model-name", "smollm2", "--dtype", "float32")
    yield server
    server.stop()
