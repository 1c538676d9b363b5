"""The simulated engine: behaves like EngineCore on the outside, never loads a model or torch."""

from __future__ import annotations

import subprocess
import sys

import httpx

from hybridlb.testing.ports import free_port_range
from hybridlb.testing.servers import Server, completion, start_servers


def test_the_engine_process_never_imports_torch(tiny_qwen3):
    code = ("import sys; import hybridlb.engine.spawn; from hybridlb.engine.core import make_core; "
            "from hybridlb.config import EngineConfig; "
            f"make_core(EngineConfig(model={tiny_qwen3!r}, simulate={{'step_ms': 1}})).step(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_serve_with_simulated_engines_answers_over_http(tiny_qwen3):
    server = Server(tiny_qwen3, "--simulate-step-ms", "2", "-dp", "2",
                    "--data-parallel-rpc-port", str(free_port_range(5)))
    (server,) = start_servers(server)
    try:
        body = completion(server.url, tiny_qwen3, prompt=[11, 12, 13], max_tokens=5, ignore_eos=True)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 5
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        assert "SIMULATED" in card["simulated"]
        ranks = httpx.get(f"{server.url}/ranks").json()
        assert sorted(e["rank"] for e in ranks["engines"]) == [0, 1]
    finally:
        server.stop()
    assert "SIMULATED" in server.output
