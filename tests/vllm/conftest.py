"""The vLLM backend's tier: runs in .venv-vllm (`just setup-vllm`, `just test-vllm`), where vLLM is
installed; elsewhere every test here is skipped."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# vLLM decides its platform when first imported; off CUDA it must be told (the engine process sets it too)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm/" in str(item.path) and not HAS_VLLM:
            item.add_marker(pytest.mark.skip(reason="vLLM is not installed here (`just setup-vllm`)"))


@pytest.fixture(scope="session")
def vllm_command() -> str:
    """The `vllm` command of this venv: vLLM's own server, the reference."""
    return str(Path(sys.executable).parent / "vllm")
