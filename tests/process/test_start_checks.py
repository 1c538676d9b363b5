"""What a start checks before it starts anything, as the user sees it: a port in use is one line
within seconds (and --dry-run says it too), vLLM flags that change nothing are taken with a
note, and every problem of a command line or a config comes in one list, from `serve`, its
--dry-run and `up` alike."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from hybridlb.testing.ports import free_port
from hybridlb.testing.servers import completion, start_server
from tests.unit.test_start_checks import _held


def _hybridlb(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", *args], capture_output=True, text=True, timeout=timeout)


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


# -- item 6: vLLM flags --------------------------------------------------------------------


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
