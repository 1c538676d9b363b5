"""One real SmolLM2 server for the structured-output and tool tests: float32 (a seeded request
gives the same tokens whatever shares its batch), Hermes tool calls through the repository's
tool-aware ChatML template (SmolLM2's own ignores tools), Qwen3-style reasoning."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridlb.testing.servers import start_server
from tests.conftest import SMOLLM2

TEMPLATE = str(Path(__file__).resolve().parents[3] / "configs" / "templates" / "chatml_tools.jinja")


@pytest.fixture(scope="session")
def structured_server():
    server = start_server(SMOLLM2, "--served-model-name", "smollm2", "--max-model-len", "1024",
                          "--kv-cache-gib", "0.2", "--chat-template", TEMPLATE, "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield server
    server.stop()
