"""One real-model `hybridlb serve` per session (SmolLM2-135M-Instruct from its GGUF file, dequantized:
its tests compare it with transformers' float32 load of the same file)."""

from __future__ import annotations

import pytest

from hybridlb.testing.servers import start_server
from tests.conftest import SMOLLM2


@pytest.fixture(scope="session")
def smollm2_server():
    server = start_server(SMOLLM2, "--served-model-name", "smollm2", "--dtype", "float32", "--quantization", "none")
    yield server
    server.stop()
