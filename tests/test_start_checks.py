"""What a start checks before it starts anything, as the user sees it: a port in use is one line
within seconds (and --dry-run says it too), vLLM flags that change nothing are taken with a
note, and every problem of a command line or a config comes in one list, from `serve`, its
--dry-run and `up` alike."""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import subprocess
import sys
import time

import pytest

from hybridlb.config import ConfigError, load_config
from tests.servers import completion, free_port, start_server


def _hybridlb(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", *args], capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def _held(*ports: int):
    """Another program listening on 127.0.0.1 at each port."""
    with contextlib.ExitStack() as stack:
        for port in ports:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", port))
            sock.listen()
        yield


def _error_lines(run: subprocess.CompletedProcess) -> list[str]:
    """The error a refused command printed: exit 2, no traceback; its lines (notes and warnings apart)."""
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if not line.startswith(("note: ", "warning: "))]
    assert lines and lines[0].startswith("error: "), run.stderr
    return lines


def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


# -- item 3: ports ---------------------------------------------------------------------------


def test_a_port_in_use_is_one_line_before_anything_loads(tiny_qwen3):
    port = free_port()
    with _held(port):
        started = time.monotonic()
        run = _hybridlb("serve", tiny_qwen3, "--port", str(port))
        took = time.monotonic() - started
    assert _error_lines(run) == [f"error: port {port} on 127.0.0.1 is in use (wanted by API server api:0: stop what "
                                 f"holds it, `ss -ltnp 'sport = :{port}'` names it, or pick another with --port "
                                 "(api.port))"]
    assert run.stderr.count("\n") == 1 and "engine" not in run.stderr  # nothing started, nothing loaded
    assert took < 3, f"{took:.1f} s"


def test_dry_run_reports_every_port_in_use_the_node_would_listen_on(tiny_qwen3):
    """A multi-port head: its ranks' ports, the supervisor's and the head's rpc block, all tried."""
    base, supervisor, rpc = free_port(), free_port(), free_port()
    flags = ["-dp", "4", "-dpl", "2", "-dpm", "--port", str(base), "--data-parallel-supervisor-port", str(supervisor),
             "-dpa", "127.0.0.1", "-dpp", str(rpc), "--dry-run"]
    free = _hybridlb("serve", tiny_qwen3, *flags)
    assert free.returncode == 0, free.stderr
    with _held(base + 1, supervisor, rpc):
        run = _hybridlb("serve", tiny_qwen3, *flags)
    lines = _error_lines(run)
    assert lines[0] == "error: 3 problems:", run.stderr
    assert f"port {base + 1} on 127.0.0.1 is in use (wanted by API server api:0.1" in lines[1]
    assert f"port {supervisor} on 127.0.0.1 is in use (wanted by the supervisor of node 0" in lines[2]
    assert "--data-parallel-supervisor-port" in lines[2]
    assert f"port {rpc} on 127.0.0.1 is in use (wanted by the rpc handshake" in lines[3]
    assert "--data-parallel-rpc-port" in lines[3]


def test_up_tries_the_ports_of_its_private_ray_cluster_before_starting_ray(tmp_path, tiny_qwen3):
    port = free_port()
    config = _write(tmp_path, {"engine": {"model": tiny_qwen3}, "api": {"port": port}})
    with _held(port):
        started = time.monotonic()
        run = _hybridlb("up", config)
        took = time.monotonic() - started
    assert _error_lines(run) == [f"error: port {port} on 127.0.0.1 is in use (wanted by API server api:0: stop what "
                                 f"holds it, `ss -ltnp 'sport = :{port}'` names it, or pick another with --port "
                                 "(api.port))"]
    assert took < 3, f"{took:.1f} s"


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
    assert serve_node._run(Runner(), SimpleNamespace(), node) == 2
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


def test_flags_that_change_nothing_serve_with_one_note_each(tiny_qwen3):
    run = _hybridlb("serve", tiny_qwen3, "--swap-space", "4", "--data-parallel-backend", "ray", "--enable-eplb",
                    "-O3", "--port", str(free_port()), "--dry-run")
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stderr.splitlines() if line.startswith("note: ")]
    assert [note.split(" has no effect")[0] for note in notes] == [
        "note: --swap-space 4", "note: --data-parallel-backend ray", "note: --enable-eplb",
        "note: --compilation-config 3"], run.stderr


def test_a_vllm_command_line_with_no_effect_flags_starts_and_serves(tiny_qwen3):
    """Not only the dry run: `--swap-space 4 --data-parallel-backend ray` start, say one note each, and serve."""
    server = start_server(tiny_qwen3, "--swap-space", "4", "--data-parallel-backend", "ray")
    try:
        assert completion(server.url, tiny_qwen3)["choices"][0]["text"]
        for flag in ("--swap-space 4", "--data-parallel-backend ray"):
            assert f"note: {flag} has no effect" in server.output, server.output
    finally:
        server.stop()


def test_every_problem_of_a_command_line_is_listed_at_once(tiny_qwen3):
    """Refused flags, an unknown one, the config's values and the speculative method: one list, one run."""
    run = _hybridlb("serve", tiny_qwen3, "--swap-space", "4", "-tp", "2", "--kv-transfer-config", "{}",
                    "--max-num-seq", "4", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}',
                    "--max-num-seqs", "0", "--dry-run")
    lines = _error_lines(run)
    assert lines[0] == "error: 5 problems:", run.stderr
    for expected, line in zip(["--tensor-parallel-size 2: ", "--kv-transfer-config: ",
                               "--max-num-seq: hybridlb serve has no such flag; did you mean --max-num-seqs?",
                               "engine.speculative: method 'eagle': hybridlb speculates by n-gram",
                               "engine.max_num_seqs: "], lines[1:], strict=True):
        assert line.startswith(f"  - {expected}"), (expected, line)
    assert "note: --swap-space 4 has no effect" in run.stderr
    unparsable = _hybridlb("serve", tiny_qwen3, "-tp", "2", "--port", "eighty", "--dry-run")
    lines = _error_lines(unparsable)
    assert lines[0] == "error: 2 problems:" and "--tensor-parallel-size 2" in lines[1] and "'--port'" in lines[2]


def test_model_options_and_ports_come_together(tmp_path, tiny_qwen3):
    port = free_port()
    with _held(port):
        run = _hybridlb("serve", tiny_qwen3, "--chat-template", str(tmp_path / "missing.jinja"), "--port", str(port),
                        "--dry-run")
    lines = _error_lines(run)
    assert lines[0] == "error: 2 problems:" and "missing.jinja does not exist" in lines[1], run.stderr
    assert f"port {port} on 127.0.0.1 is in use" in lines[2], run.stderr


# -- item 9: --dry-run is the start's check; configs ------------------------------------------


def test_dry_run_warns_where_the_start_warns(tiny_qwen3):
    run = _hybridlb("serve", tiny_qwen3, "--gpu-memory-utilization", "0.8", "--port", str(free_port()), "--dry-run")
    assert run.returncode == 0, run.stderr
    assert "warning: gpu_memory_utilization applies on CUDA; on CPU kv_cache_gib (0.5 GiB) sizes the KV cache" \
        in run.stderr.splitlines()


def test_a_config_with_several_errors_lists_them_all_in_serve_and_up(tmp_path, tiny_qwen3):
    values = _write(tmp_path, {"engine": {"model": tiny_qwen3, "max_num_seq": 4, "block_size": 0},
                               "api": {"port": 99999}})
    expected = ["error: 3 problems:", "  - engine.block_size: Input should be greater than or equal to 1",
                "  - engine.max_num_seq: unknown key; did you mean `max_num_seqs`?",
                "  - api.port: Input should be less than or equal to 65535"]
    assert _error_lines(_hybridlb("serve", "--config", values, "--dry-run")) == expected
    assert _error_lines(_hybridlb("up", values)) == expected
    (tmp_path / "later").mkdir()
    later = _write(tmp_path / "later", {"engine": {"model": tiny_qwen3}, "api": {
        "chat_template": str(tmp_path / "missing.jinja"), "port": free_port()}, "data_parallel": {
        "size": 2, "nodes": [{"size_local": 1}]}})
    for run in (_hybridlb("serve", "--config", later, "--dry-run"), _hybridlb("up", later)):
        lines = _error_lines(run)
        assert lines[0] == "error: 2 problems:" and "missing.jinja does not exist" in lines[1], run.stderr
        assert "no node runs rank(s) 1" in lines[2], run.stderr


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
