"""/metrics read the way its real consumers read it: llm-d's endpoint picker (three gauges,
one series per engine) and vLLM's stock Grafana dashboard (every panel's metric family)."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridlb.testing.servers import completion, start_server

# The families the panels of vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana)
# query, under the names vLLM exports today (its cache and time-per-token panels were renamed
# to kv_cache_usage_perc and inter_token_latency_seconds).
DASHBOARD = ["vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
             "vllm:inter_token_latency_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens",
             "vllm:request_generation_tokens", "vllm:request_success", "vllm:request_queue_time_seconds",
             "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
             "vllm:request_max_num_generation_tokens"]
PICKER = ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"]


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    # 2 ranks; a KV cache too small for every request at once, so some are preempted
    server = start_server(tiny_qwen3, "--data-parallel-size", "2", "--kv-cache-gib", "0.0005", "--block-size", "16",
                          "--max-model-len", "256")
    yield server
    assert server.stop() == 0


def families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}


def test_llm_d_picker_finds_its_three_gauges_once_per_engine(server):
    found = families(server.url)
    for name in PICKER:
        family = found[name]
        assert family.type == "gauge"
        assert sorted(s.labels["engine"] for s in family.samples) == ["0", "1"]
        assert all(s.labels["model_name"] == server.model for s in family.samples)
    info = found["vllm:cache_config_info"].samples
    assert sorted(s.labels["engine"] for s in info) == ["0", "1"] and all(s.labels["block_size"] == "16" for s in info)


def test_every_dashboard_panel_has_a_series_after_traffic(server):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: completion(server.url, server.model, f"Request {i}", max_tokens=100, ignore_eos=True),
                      range(16)))
    found = families(server.url)
    for name in DASHBOARD:
        family = found.get(name)
        assert family is not None and family.samples, f"{name}: no series"
        assert any(s.labels.get("model_name") == server.model for s in family.samples), name
    counts = {s.labels["engine"]: s.value for s in found["vllm:request_prompt_tokens"].samples
              if s.name.endswith("_count")}
    assert sum(counts.values()) == 16 and set(counts) == {"0", "1"}
    queue = sum(s.value for s in found["vllm:request_queue_time_seconds"].samples if s.name.endswith("_count"))
    assert queue == 16
    preempted = sum(s.value for s in found["vllm:num_preemptions"].samples if s.name.endswith("_total"))
    assert preempted > 0, "16 x 100 tokens in 2 caches of a few blocks each must preempt"


def _per_engine(found: dict, name: str, label: str | None = None) -> dict:
    return {(s.labels["engine"], s.labels[label]) if label else s.labels["engine"]: s.value
            for s in found[name].samples if s.name.endswith("_total")}


def test_each_engines_time_is_accounted_by_step_kind_and_loop_phase(server):
    """What benchmarks/time_accounting.py reads: every position an engine computed is in one
    kind of step, and its loop's phases add up to its wall time."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: completion(server.url, server.model, f"Count to {i}", max_tokens=24, ignore_eos=True),
                      range(8)))
    time.sleep(1.5)  # the engines' next heartbeat carries their totals
    found = families(server.url)
    tokens = _per_engine(found, "hybridlb:engine_step_tokens", "kind")
    steps = _per_engine(found, "hybridlb:engine_steps", "kind")
    seconds = _per_engine(found, "hybridlb:engine_step_seconds", "kind")
    loop = _per_engine(found, "hybridlb:engine_loop_seconds", "phase")
    uptime = _per_engine(found, "hybridlb:engine_uptime_seconds")
    prompt, generated = _per_engine(found, "vllm:prompt_tokens"), _per_engine(found, "vllm:generation_tokens")
    requests = {engine: sum(s.value for s in found["vllm:request_success"].samples
                            if s.labels["engine"] == engine and s.name.endswith("_total")) for engine in ("0", "1")}
    for engine in ("0", "1"):
        assert steps[engine, "decode"] > 0 and steps.get((engine, "prefill"), 0) + steps.get((engine, "mixed"), 0) > 0
        computed = sum(v for (e, _), v in tokens.items() if e == engine)
        # every prompt position and every output token but each request's last (preemption recomputes more)
        assert computed >= prompt[engine] + generated[engine] - requests[engine], (engine, tokens)
        phases = {phase: v for (e, phase), v in loop.items() if e == engine}
        assert set(phases) == {"idle", "take", "step", "publish"}
        assert sum(phases.values()) == pytest.approx(uptime[engine], abs=0.01)
        assert phases["idle"] > 0.5 * uptime[engine]  # a test server waits far more than it steps
        assert sum(v for (e, _), v in seconds.items() if e == engine) <= phases["step"]
