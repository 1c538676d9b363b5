"""`hybridlb up` with `engine.backend: vllm`: Ray places two vLLM ranks and the API server, and both
ranks take traffic."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from hybridlb.testing.ports import free_port
from hybridlb.testing.servers import interrupt, up_until_ready

pytestmark = pytest.mark.slow


def test_up_places_two_vllm_ranks_that_both_serve(smollm2_hf_dir, tmp_path):
    port = free_port()
    config = {"engine": {"model": smollm2_hf_dir, "backend": "vllm", "dtype": "float32", "enforce_eager": True,
                         "max_model_len": 512, "kv_cache_gib": 0.3},
              "api": {"port": port, "served_model_name": "smollm2"}, "data_parallel": {"size": 2},
              "lb": {"mode": "hybrid"}, "ray": {"name": "vllm-backend", "cpus_per_engine": 1}}
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(config))
    process, lines = up_until_ready(path, 300)
    try:
        url = f"http://127.0.0.1:{port}"

        def ask(i: int) -> str:
            body = {"model": "smollm2", "prompt": f"List number {i}:", "max_tokens": 24, "temperature": 0}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, range(8)))
        assert all(texts) and httpx.get(f"{url}/ranks").json()["ranks"] == [0, 1]
        served: dict[int, float] = {}
        for rank, value in re.findall(r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)$',
                                      httpx.get(f"{url}/metrics").text, re.M):
            served[int(rank)] = served.get(int(rank), 0) + float(value)
        assert set(served) == {0, 1} and sum(served.values()) == 8, served
        assert texts == [ask(i) for i in range(8)]  # greedy: the same text whichever rank served it
    finally:
        interrupt(process, lines)
