"""With --engine-backend vllm, vLLM's engine flags that hybridlb's own engine would refuse or
ignore go to vLLM's engine as written (--vllm-args); hybridlb's own flags keep their meaning, and
without the backend nothing changes (issue 53, item 2)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from hybridlb.cli import _serve_flags
from hybridlb.cli.vllm_args import translate_all

KNOWN = _serve_flags()


def _line(*flags: str) -> tuple[list[str], list[str], list[str]]:
    return translate_all(["m", *flags], KNOWN)


def _handed(out: list[str]) -> dict:
    """The --vllm-args JSON object the translation put on the command line (the only one)."""
    assert out.count("--vllm-args") == 1, out
    return json.loads(out[out.index("--vllm-args") + 1])


VLLM_LINE = ("-tp", "2", "--kv-cache-dtype", "fp8", "--trust-remote-code", "--quantization", "awq",
             "--some-new-vllm-flag", "x")


@pytest.mark.parametrize("backend", [("--engine-backend", "vllm"), ("--engine-backend=vllm",),
                                     ("--engine_backend", "vllm")], ids=" ".join)
def test_vllms_engine_flags_are_handed_to_vllm_with_a_note(backend):
    out, notes, problems = _line(*backend, *VLLM_LINE)
    assert problems == []
    assert out[:2 + len(backend)] == ["--model", "m", *[word.replace("_", "-") for word in backend]]
    assert _handed(out) == {"tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "trust_remote_code": True,
                            "quantization": "awq", "some_new_vllm_flag": "x"}
    assert notes == ["handed to vLLM's engine: --tensor-parallel-size 2, --kv-cache-dtype fp8, --trust-remote-code, "
                     "--quantization awq, --some-new-vllm-flag x (engine.vllm_args)"]


def test_without_the_backend_the_same_line_has_todays_problems():
    out, notes, problems = _line(*VLLM_LINE)
    assert out == ["--model", "m"]
    assert [problem.split(":")[0] for problem in problems] == [
        "--tensor-parallel-size 2", "--kv-cache-dtype fp8", "--quantization awq", "--some-new-vllm-flag"]
    assert len(notes) == 1 and notes[0].startswith("--trust-remote-code has no effect")


def test_a_backend_other_than_vllm_or_a_later_one_changes_nothing():
    for backend in (["--engine-backend", "hybridlb"], ["--engine-backend", "vllm", "--engine-backend", "hybridlb"]):
        out, _, problems = _line(*backend, "-tp", "2")
        assert "--vllm-args" not in out and problems[0].startswith("--tensor-parallel-size 2"), (backend, problems)


@pytest.mark.parametrize(("flags", "handed"), [
    (("--no-enable-chunked-prefill",), {"enable_chunked_prefill": False}),
    (("--enable-chunked-prefill",), {"enable_chunked_prefill": True}),
    (("--no-trust-remote-code",), {"trust_remote_code": False}),
    (("--gpu_memory_fraction=0.5", "--max-seq-len-to-capture", "8192"),
     {"gpu_memory_fraction": 0.5, "max_seq_len_to_capture": 8192}),
    (("--eplb-config", '{"window_size": 1000}', "--enable-eplb"),
     {"eplb_config": {"window_size": 1000}, "enable_eplb": True}),
    (("--cudagraph-capture-sizes", "[1, 2, 4]"), {"cudagraph_capture_sizes": [1, 2, 4]}),
    (("-pp", "2", "--load-format", "dummy", "--download-dir", "/models", "--lora-dtype", "float16"),
     {"pipeline_parallel_size": 2, "load_format": "dummy", "download_dir": "/models", "lora_dtype": "float16"}),
    (("--swap-space", "4", "--cpu-offload-gb", "8", "--distributed-executor-backend", "mp", "--async-scheduling",
      "--enable-dbo", "--fully-sharded-loras", "--all2all-backend", "pplx", "--moe-backend", "triton",
      "--dbo-decode-token-threshold", "32"),
     {"swap_space": 4, "cpu_offload_gb": 8, "distributed_executor_backend": "mp", "async_scheduling": True,
      "enable_dbo": True, "fully_sharded_loras": True, "all2all_backend": "pplx", "moe_backend": "triton",
      "dbo_decode_token_threshold": 32}),
    (("-O3",), {"optimization_level": 3}),
    (("-O", "2"), {"optimization_level": 2}),
    (("-O.mode=3", "--compilation-config.pass_config.fuse_norm_quant", "true"),
     {"compilation_config": {"mode": 3, "pass_config": {"fuse_norm_quant": True}}}),
    (("-cc", '{"cudagraph_mode": "FULL"}', "-dcp", "2"),
     {"compilation_config": {"cudagraph_mode": "FULL"}, "decode_context_parallel_size": 2}),
    (("-tp", "2", "-tp", "4"), {"tensor_parallel_size": 4}),
])
def test_values_are_typed_as_vllm_reads_them(flags, handed):
    out, notes, problems = _line("--engine-backend", "vllm", *flags)
    assert problems == [] and _handed(out) == handed and len(notes) == 1, (out, notes, problems)


def test_hybridlbs_own_flags_keep_their_meaning():
    out, notes, problems = _line("--engine-backend", "vllm", "--dtype", "half", "--max-model-len", "32k",
                                 "--max_num_seqs", "8", "--no-enable-prefix-caching", "--seed", "1", "-dp", "2",
                                 "--data-parallel-hybrid-lb", "--quantization", "none", "-tp", "2")
    assert problems == []
    assert out == ["--model", "m", "--engine-backend", "vllm", "--dtype", "float16", "--max-model-len", "32000",
                   "--max-num-seqs", "8", "--no-enable-prefix-caching", "--seed", "1", "--data-parallel-size", "2",
                   "--quantization",
                   "none", "--vllm-args", '{"tensor_parallel_size": 2}', "--lb-mode", "hybrid"]
    assert notes == ["handed to vLLM's engine: --tensor-parallel-size 2 (engine.vllm_args)"]


def test_hybridlbs_own_quantization_methods_stay_hybridlbs():
    for method in ("int8", "int4", "gguf"):  # the config refuses them with backend vllm, saying what to do
        out, notes, problems = _line("--engine-backend", "vllm", "--quantization", method)
        assert out[-2:] == ["--quantization", method] and "--vllm-args" not in out and problems == []
    out, notes, _ = _line("--engine-backend", "vllm", "--quantization", "None")
    assert "--vllm-args" not in out and notes[0].startswith("--quantization None: left unset")


def test_launcher_and_api_server_flags_are_not_vllms_engine_arguments():
    out, notes, problems = _line("--engine-backend", "vllm", "--kv-transfer-config", "{}", "--disable-log-requests",
                                 "--disable-log-stats", "--data-parallel-backend", "slurm",
                                 "--disable-access-log-for-endpoints", "/health")
    assert "--vllm-args" not in out
    assert [problem.split(":")[0] for problem in problems] == ["--kv-transfer-config",
                                                               "--data-parallel-backend slurm"]
    assert [note.split(" has no effect")[0] for note in notes] == [
        "--disable-log-requests", "--disable-log-stats", "--disable-access-log-for-endpoints /health"]


def test_a_dotted_flag_of_one_of_hybridlbs_own_stays_a_problem():
    out, _, problems = _line("--engine-backend", "vllm", "--speculative-config.method", "ngram",
                             "--no-enforce-eager")
    assert "--vllm-args" not in out
    assert problems == ["--speculative-config.method: hybridlb serve has no such flag; did you mean "
                        "--speculative-config?", "--no-enforce-eager: hybridlb serve has no such flag; did you mean "
                        "--enforce-eager?"]


def test_an_engine_flag_without_its_value_is_a_problem():
    out, _, problems = _line("--engine-backend", "vllm", "--kv-cache-dtype", "--max-num-seqs", "4")
    assert problems == ["--kv-cache-dtype: give it a value (vLLM's engine argument kv_cache_dtype)"]
    assert out[-2:] == ["--max-num-seqs", "4"] and "--vllm-args" not in out


def test_an_explicit_vllm_args_is_merged_and_its_keys_win():
    out, notes, problems = _line("--engine-backend", "vllm", "--vllm-args", '{"tensor_parallel_size": 4, '
                                 '"compilation_config": {"mode": 0}}', "-tp", "2", "--kv-cache-dtype", "fp8",
                                 "-O.cudagraph_mode=FULL")
    assert problems == []
    assert _handed(out) == {"tensor_parallel_size": 4, "kv_cache_dtype": "fp8",
                            "compilation_config": {"cudagraph_mode": "FULL", "mode": 0}}
    assert notes[1] == "--vllm-args sets these itself, and its values are the ones used: --tensor-parallel-size 2"
    assert len(notes) == 2
    out, notes, _ = _line("--engine-backend", "vllm", "--vllm-args", '{"enforce_eager": true}')
    assert _handed(out) == {"enforce_eager": True} and notes == []


def test_an_explicit_vllm_args_that_is_not_an_object_is_left_for_the_config_options_to_refuse():
    out, _, problems = _line("--engine-backend", "vllm", "--vllm-args", "[1]", "-tp", "2")
    assert problems == [] and out[-2:] == ["--vllm-args", "[1]"] and out.count("--vllm-args") == 1


@pytest.mark.parametrize(("flags", "vllm_args"), [
    (("-tp", "2"), {"tensor_parallel_size": 2}),
    (("--vllm-args", '{"tensor_parallel_size": 4}', "-tp", "2", "--no-enable-chunked-prefill"),
     {"tensor_parallel_size": 4, "enable_chunked_prefill": False}),
], ids=["tp", "explicit-vllm-args"])
def test_serve_builds_the_config_with_the_flags_in_vllm_args(tmp_path, monkeypatch, flags, vllm_args):
    """The whole command line: hybridlb.cli.main translates it, typer parses it, the config takes it
    (stopped before the start checks, which need vLLM installed)."""
    from hybridlb import cli
    serve_module = importlib.import_module("hybridlb.cli.serve")  # hybridlb.cli.serve is also the command

    built = []

    def stop(cfg, problems, dry_run):
        built.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(serve_module, "check_start", stop)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(sys, "argv", ["hybridlb", "serve", str(tmp_path), "--engine-backend", "vllm", *flags])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 0 and len(built) == 1
    assert built[0].engine.backend == "vllm"
    assert built[0].engine.vllm_args == vllm_args
