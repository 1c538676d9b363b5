"""What a start checks before it starts anything, as the user sees it: a port in use is one line
within seconds (and --dry-run says it too), vLLM flags that change nothing are taken with a
note, and every problem of a command line or a config comes in one list, from `serve`, its
--dry-run and `up` alike."""

from __future__ import annotations

import contextlib
import errno
import socket
import sys

import pytest

from hybridlb.config import ConfigError, load_config
from hybridlb.testing.ports import free_port


@contextlib.contextmanager
def _held(*ports: int):
    """Another program listening on 127.0.0.1 at each port."""
    with contextlib.ExitStack() as stack:
        for port in ports:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", port))
            sock.listen()
        yield


# -- item 3: ports ---------------------------------------------------------------------------


def test_a_port_taken_after_the_check_is_still_one_line(tiny_qwen3, monkeypatch, capsys):
    """The race: the port is free when tried, taken when the API server's socket is bound (before
    any engine loads, so nothing has started)."""
    from hybridlb import cli
    from hybridlb.launch import ports

    monkeypatch.setattr(ports, "try_ports", lambda wanted: ([], []))  # every port looked free
    port = free_port()
    monkeypatch.setattr(sys, "argv", ["hybridlb", "serve", tiny_qwen3, "--port", str(port)])
    with _held(port), pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: port {port} on 127.0.0.1 is in use (wanted by API server api:0: stop what "
                                f"holds it, `ss -ltnp 'sport = :{port}'` names it, or pick another with --port "
                                "(api.port))"], err


def test_a_launcher_port_taken_while_starting_is_one_log_line(monkeypatch, caplog):
    """The supervisor's or the handshake's port, taken between the check and the node's start."""
    from types import SimpleNamespace

    from hybridlb.launch import serve_node

    class Signals:
        def __init__(self, *_, **__):
            self.starting, self.requested = True, False

    class Runner:
        def start(self):
            raise OSError(errno.EADDRINUSE, "Address already in use")

        def stop(self):
            pass

        kill = request_stop = stop

    monkeypatch.setattr(serve_node.lifecycle, "StopSignals", Signals)
    node = SimpleNamespace(index=0)
    config = SimpleNamespace(api=SimpleNamespace(shutdown_timeout_s=0.0))
    assert serve_node._run(Runner(), config, node) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "was taken after the start-up check" in errors[0], errors


# -- item 6: vLLM flags --------------------------------------------------------------------


CHANGE_NOTHING = {  # flag(s) → what the note says
    ("--swap-space", "4"): "preempted requests are recomputed",
    ("--data-parallel-backend", "ray"): "`hybridlb up config.yaml` is the Ray path",
    ("-dpb", "mp"): "runs plain processes",
    ("--enable-eplb",): "expert-parallel load balancing",
    ("--eplb-config", '{"window_size": 1000}'): "expert-parallel load balancing",
    ("--async-scheduling",): "schedules in its own loop",
    ("--no-async-scheduling",): "schedules in its own loop",
    ("-O3",): "does not compile the model",
    ("--compilation-config", '{"cudagraph_mode": "FULL"}'): "does not compile the model",
    ("--distributed-executor-backend", "ray"): "no executor",
    ("--cpu-offload-gb", "4"): "weights are not offloaded",
    ("--fully-sharded-loras",): "shards LoRA layers under tensor parallelism",
    ("--load-format", "safetensors"): "their own safetensors or GGUF files",
    ("--lora-dtype", "auto"): "adapters run in the model's dtype",
    ("--kv-cache-dtype", "auto"): "the model's dtype",
    ("-tp", "1"): "one device per engine",
}
REFUSED = {  # flag(s) → what the problem says
    ("-tp", "2"): "--tensor-parallel-size 2: tensor parallelism is not implemented",
    ("-pp", "2"): "--pipeline-parallel-size 2: pipeline parallelism is not implemented",
    ("--kv-cache-dtype", "fp8"): "--kv-cache-dtype fp8: the KV cache is kept in the model's dtype",
    ("--lora-dtype", "float16"): "--lora-dtype float16: adapters run in the model's dtype",
    ("--load-format", "dummy"): "--load-format dummy: checkpoints load from safetensors or GGUF",
    ("--kv-transfer-config", "{}"): "--kv-transfer-config: disaggregated prefill/decode",
    ("--download-dir", "/models"): "--download-dir: nothing is downloaded",
    ("--data-parallel-backend", "slurm"): "--data-parallel-backend slurm: vLLM's backends are mp and ray",
}


@pytest.mark.parametrize("flags", list(CHANGE_NOTHING), ids=" ".join)
def test_a_vllm_flag_that_changes_nothing_here_is_taken_with_a_note(flags):
    from hybridlb.cli.vllm_args import translate_all

    out, notes, problems = translate_all(["m", *flags])
    assert problems == [] and out == ["--model", "m"]
    assert len(notes) == 1 and "has no effect" in notes[0] and CHANGE_NOTHING[flags] in notes[0], notes


@pytest.mark.parametrize("flags", list(REFUSED), ids=" ".join)
def test_a_vllm_flag_whose_meaning_would_change_is_refused(flags):
    from hybridlb.cli.vllm_args import translate_all

    out, notes, problems = translate_all(["m", *flags])
    assert out == ["--model", "m"] and notes == []
    assert len(problems) == 1 and problems[0].startswith(REFUSED[flags]), problems


# -- item 9: --dry-run is the start's check; configs ------------------------------------------


@pytest.mark.parametrize(("text", "hint"), [
    ("engine: {model: m, max_num_seq: 4}", "engine.max_num_seq: unknown key; did you mean `max_num_seqs`?"),
    ("engine: {model: m, gpu-memory-utilization: 0.5}", "did you mean `gpu_memory_utilization`?"),
    ("engine: {model: m, lora: {max_lora: 2}}", "engine.lora.max_lora: unknown key; did you mean `max_loras`?"),
    ("engine: {model: m, port: 8000}", "engine.port: unknown key; did you mean `api.port`?"),
    ("engine: {model: m}\ndata_parallel: {size: 1, nodes: [{size_local: 1, api_prot: 9000}]}",
     "data_parallel.nodes.0.api_prot: unknown key; did you mean `api_port`?"),
    ("engine: {model: m}\nengin: {}", "engin: unknown key; did you mean `engine`?"),
    ("engine: {model: m, zzz: 1}", "engine.zzz: unknown key; remove it or check its spelling"),
])
def test_an_unknown_config_key_gets_the_nearest_name(tmp_path, text, hint):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert hint in str(info.value), str(info.value)


def test_cross_field_problems_of_a_section_come_together(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("engine: {model: m, device: cuda, dtype: float16, quantization: int8, simulate: {step_ms: 1}, "
                    "speculative: {method: ngram, num_speculative_tokens: 2}}")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = str(info.value).splitlines()[1:]
    assert len(problems) == 3 and all(p.startswith("  engine.") for p in problems), problems


def test_every_serve_flag_has_help():
    import typer

    from hybridlb.cli import app

    serve = typer.main.get_command(app).commands["serve"]
    bare = [param.opts[0] for param in serve.params if (param.help or "").replace("[vLLM]", "").strip() == ""]
    assert bare == []
