"""The command line, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridlb import LLM, SamplingParams


def _hybridlb(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_make_model_then_generate(tmp_path):
    out = tmp_path / "llama"
    made = _hybridlb("make-model", "--arch", "llama", "--size", "tiny", "--seed", "3", "--out", str(out))
    assert made.returncode == 0, made.stderr
    run = _hybridlb("generate", "--model", str(out), "--prompt", "The weather", "--prompt", "GPU",
                    "--max-tokens", "6", "--ignore-eos", "--json")
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    expected = LLM(str(out)).generate(["The weather", "GPU"], SamplingParams(max_tokens=6, temperature=0,
                                                                          ignore_eos=True))
    assert [line["token_ids"] for line in lines] == [e.token_ids for e in expected]
    assert [line["text"] for line in lines] == [e.text for e in expected]


def test_default_config_makes_its_checkpoint_on_first_use(tmp_path):
    config = tmp_path / "local.yaml"
    config.write_text("engine: {model: models/m, make_if_missing: {arch: qwen3, size: tiny}, max_model_len: 128}\n")
    run = _hybridlb("generate", "--config", str(config), "--prompt", "Hi", "--max-tokens", "3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "models/m/config.json").exists()
    assert run.stdout.startswith("Hi")


def test_errors_are_one_clear_line(tmp_path):
    missing = _hybridlb("generate", "--model", str(tmp_path / "none"), "--prompt", "x")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    bad_arch = _hybridlb("make-model", "--arch", "gpt2", "--out", str(tmp_path / "g"))
    assert bad_arch.returncode == 2 and "unknown arch 'gpt2'" in bad_arch.stderr
    no_model = _hybridlb("generate", "--prompt", "x")
    assert no_model.returncode == 2 and "--model" in no_model.stderr


def test_generate_takes_a_gguf_model_and_the_default_config():
    from tests.conftest import SMOLLM2

    params = SamplingParams(max_tokens=8, temperature=0)
    expected = LLM(SMOLLM2, max_model_len=256, num_kv_blocks=32).generate(["The capital of France is"], params)[0]
    for source in (["--model", SMOLLM2], ["--config", "configs/local.yaml"]):
        run = _hybridlb("generate", *source, "--prompt", "The capital of France is", "--max-tokens", "8", "--json")
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["token_ids"] == expected.token_ids
    assert "Paris" in expected.text


# vLLM's own data-parallel deployment commands (its docs) and llm-d's wide-EP pod command,
# in vLLM's spelling, checked with --dry-run (what this node would start).
VLLM_HEAD = ["-dp", "4", "-dpl", "2", "-dpa", "10.99.48.128", "-dpp", "13345"]
VLLM_WORKER = ["--headless", "--data-parallel-size", "4", "--data-parallel-size-local", "2",
               "--data-parallel-start-rank", "2", "--data-parallel-address", "10.99.48.128",
               "--data-parallel-rpc-port", "13345"]
LLM_D_WIDE_EP = ["--port", "8200", "--disable-log-requests", "--disable-uvicorn-access-log", "--enable-expert-parallel",
                 "--data-parallel-hybrid-lb", "--tensor-parallel-size", "1", "--data-parallel-size", "4",
                 "--data-parallel-size-local", "2", "--data-parallel-address", "leader.lws", "--data-parallel-rpc-port",
                 "5555", "--data-parallel-start-rank", "2", "--trust-remote-code", "--kv_transfer_config",
                 '{"kv_connector":"NixlConnector","kv_role":"kv_both"}', "--async-scheduling", "--enable-dbo",
                 "--dbo-decode-token-threshold", "32", "--enable-eplb", "--eplb-config", '{"window_size":"1000"}',
                 "--compilation_config", '{"cudagraph_mode":"FULL_DECODE_ONLY"}', "--kv-events-config",
                 '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv@10.0.0.7@m"}']
NOT_IMPLEMENTED = ["--kv-transfer-config"]
# Flags of that command that change nothing here (speed only): taken with a note each.
NO_EFFECT = ["--async-scheduling", "--enable-eplb", "--eplb-config", "--compilation-config", "--enable-dbo"]
# llm-d's current wide-EP decode and prefill pods (guides/wide-ep-lws), for a 2-pod group of 2 ranks
# each, as the second pod (START_RANK 2): multi-port ranks under a supervisor.
LLM_D_DECODE = ["--port", "8200", "--disable-access-log-for-endpoints=/health,/metrics",
                "--data-parallel-multi-port-external-lb", "--data-parallel-supervisor-port=8208",
                "--enable-expert-parallel", "--tensor-parallel-size", "1", "--max-num-batched-tokens", "256",
                "--max-num-seqs", "256", "--data-parallel-size", "4", "--data-parallel-size-local", "2",
                "--data-parallel-address", "leader.lws", "--data-parallel-rpc-port", "5555",
                "--data-parallel-start-rank", "2", "--kv_transfer_config",
                '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"fail"}',
                "--enable-dbo", "--dbo-decode-token-threshold", "32", "--all2all-backend", "deepep_low_latency",
                "--moe-backend", "deep_gemm"]
LLM_D_PREFILL = ["--port", "8000", "--enforce-eager", "--gpu-memory-utilization", "0.80",
                 "--disable-access-log-for-endpoints=/health,/metrics", "--data-parallel-multi-port-external-lb",
                 "--data-parallel-supervisor-port", "8008", "--enable-expert-parallel", "--tensor-parallel-size", "1",
                 "--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-address",
                 "leader.lws", "--data-parallel-rpc-port", "5555", "--data-parallel-start-rank", "2",
                 "--kv_transfer_config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}', "--moe-backend",
                 "deep_gemm", "--all2all-backend", "deepep_high_throughput"]


def test_vllm_data_parallel_commands_run_as_vllm_documents_them(checkpoints):
    model = checkpoints("qwen3")
    head = _hybridlb("serve", model, *VLLM_HEAD, "--dry-run")
    assert head.returncode == 0, head.stderr
    assert "this node: 0, ranks [0, 1], API servers api:0@" in head.stdout and "size 4" in head.stdout
    assert "vLLM would run internal LB" in head.stderr  # the one default that differs is said, not hidden
    worker = _hybridlb("serve", model, *VLLM_WORKER, "--dry-run")
    assert worker.returncode != 0 and "--lb-mode internal" in worker.stderr
    internal = _hybridlb("serve", model, *VLLM_WORKER, "--lb-mode", "internal", "--dry-run")
    assert internal.returncode == 0, internal.stderr
    assert "this node: 1, ranks [2, 3], headless" in internal.stdout and "mode: internal" in internal.stdout
    hybrid = _hybridlb("serve", model, *VLLM_WORKER[1:], "-dph", "--dry-run")
    assert hybrid.returncode == 0 and "this node: 1, ranks [2, 3], API servers api:1@" in hybrid.stdout, hybrid.stderr
    external = _hybridlb("serve", model, "--data-parallel-size", "2", "--data-parallel-rank", "1",
                         "--data-parallel-external-lb", "--port", "8001", "--dry-run")
    assert external.returncode == 0, external.stderr
    assert "mode: external" in external.stdout and "ranks [1], API servers api:1.0@127.0.0.1:8001" in external.stdout


def test_llm_d_wide_ep_command_names_each_flag_it_cannot_honour(checkpoints):
    model = checkpoints("qwen3_moe")
    run = _hybridlb("serve", model, *LLM_D_WIDE_EP, "--dry-run")
    assert run.returncode == 2
    for flag in NOT_IMPLEMENTED:
        assert flag in run.stderr.split("error:")[1], flag
    for flag in NO_EFFECT:
        assert f"note: {flag}" in run.stderr.split("error:")[0], flag
    assert "drop the flag" in run.stderr and "--trust-remote-code" not in run.stderr.split("error:")[1]
    assert "--kv-events-config" not in run.stderr  # KV-cache events are implemented
    kept, skip = [], 0
    for arg in LLM_D_WIDE_EP:  # what is left once the unimplemented flags are dropped
        if skip:
            skip -= 1
        elif arg.replace("_", "-") in NOT_IMPLEMENTED:
            skip = 1
        else:
            kept.append(arg)
    run = _hybridlb("serve", model, *kept, "--dry-run")
    assert run.returncode == 0, run.stderr
    assert "this node: 1, ranks [2, 3], API servers api:1@127.0.0.1:8200" in run.stdout
    assert "experts sharded over 4 ranks stepping in lockstep" in run.stdout and "mode: hybrid" in run.stdout


def test_vllm_spellings_of_lengths_dtypes_and_names(checkpoints):
    run = _hybridlb("serve", checkpoints("qwen3"), "--max_model_len", "1K", "--dtype", "half", "--served-model-name",
                    "first", "second", "--enforce-eager", "-tp", "1", "--dry-run")
    assert run.returncode == 0, run.stderr
    assert "max_model_len 1024" in run.stdout and "dtype float16" in run.stdout
    assert "model ['first', 'second']" in run.stdout and "eager (no decode program)" in run.stdout
    bad = _hybridlb("serve", checkpoints("qwen3"), "--max-model-len", "lots", "-tp", "2", "--dtype", "fp8")
    assert bad.returncode == 2
    assert "--max-model-len lots: not a token count" in bad.stderr and "--tensor-parallel-size 2" in bad.stderr
    assert "--dtype fp8: use one of" in bad.stderr


@pytest.mark.parametrize("command", [LLM_D_DECODE, LLM_D_PREFILL], ids=["decode", "prefill"])
def test_llm_d_multi_port_commands_run_but_for_kv_transfer(checkpoints, command):
    """Only --kv-transfer-config (prefill/decode disaggregation) is refused; the GPU-kernel choices are
    accepted with a note each, and without it the pod plans llm-d's ports and supervisor."""
    model = checkpoints("qwen3_moe")
    refused = _hybridlb("serve", model, *command, "--dry-run")
    assert refused.returncode == 2 and "--kv-transfer-config" in refused.stderr
    assert refused.stderr.count("drop the flag") == 1, refused.stderr
    at = command.index("--kv_transfer_config")
    run = _hybridlb("serve", model, *command[:at], *command[at + 2:], "--dry-run")
    assert run.returncode == 0, run.stderr
    base, supervisor = (8200, 8208) if command is LLM_D_DECODE else (8000, 8008)
    assert (f"API servers api:1.0@127.0.0.1:{base}→[2], api:1.1@127.0.0.1:{base + 1}→[3], "
            f"supervisor :{supervisor}") in run.stdout, run.stdout
    assert "mode: multi_port" in run.stdout and "experts sharded over 4 ranks" in run.stdout
    for flag in ("--all2all-backend", "--moe-backend", "--disable-access-log-for-endpoints"):
        assert f"note: {flag}" in run.stderr, flag
