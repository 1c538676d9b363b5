"""`hybridlb status / down / up --detach` joining a Ray cluster it did not start: one that
`ray start --head` started with token authentication, and a stale address record. Each failure is
one line within seconds, never Ray's 20 s of `gcs_client` warnings."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from hybridlb.testing.ports import free_port

_RAY_ENV = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR", "TMPDIR")


def _env(root: Path, **extra: str) -> dict[str, str]:
    """This machine as a user of the cluster under ``root`` sees it: its HOME, its Ray temp dir."""
    env = {k: v for k, v in os.environ.items() if k not in _RAY_ENV}
    # the compiled kernels stay in the real cache (~/.cache/hybridlb): a fresh HOME rebuilds them, minutes
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return env | {"HOME": str(root / "home"), "RAY_TMPDIR": str(root), "XDG_CACHE_HOME": cache} | extra


def _hybridlb(env: dict[str, str], *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hybridlb", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    return done, time.monotonic() - started


def _one_line_failure(done: subprocess.CompletedProcess, seconds: float) -> str:
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert seconds < 5, f"{seconds:.1f} s: {output}"
    assert "gcs_client" not in output and len(output.strip().splitlines()) == 1, output
    return output


@pytest.fixture(scope="module")
def token_head():
    """`ray start --head` with RAY_AUTH_MODE=token; its token in a private HOME (never the real
    ~/.ray), its address recorded under a private Ray temp dir. Stopped by its process group."""
    root = Path(tempfile.mkdtemp(prefix="hlb-", dir="/tmp"))  # short: Ray's socket paths live under it
    token = secrets.token_hex(32)
    (root / "home" / ".ray").mkdir(parents=True)
    (root / "home" / ".ray" / "auth_token").write_text(token)
    ports = ("port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
             "metrics-export-port")
    command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--num-cpus", "4",
               "--temp-dir", str(root / "ray"), "--disable-usage-stats",
               *[arg for name in ports for arg in (f"--{name}", str(free_port()))]]
    env = _env(root, RAY_AUTH_MODE="token")
    start = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # its daemons stay in this process group
    try:
        output, _ = start.communicate(timeout=120)
        assert start.returncode == 0, output
        yield root, token
    finally:
        _stop_group(start.pid)
        shutil.rmtree(root, ignore_errors=True)


def _stop_group(group: int) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def test_status_and_down_join_a_token_cluster(token_head):
    root, _ = token_head
    for command in ("status", "down"):
        done, seconds = _hybridlb(_env(root), command, "nothere")
        assert _one_line_failure(done, seconds).strip() == "error: no cluster named 'nothere' in namespace 'hybridlb'"


def test_token_from_ray_auth_token_path(token_head, tmp_path):
    root, token = token_head
    (tmp_path / "token").write_text(token)
    env = _env(root, HOME=str(tmp_path), RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    done, seconds = _hybridlb(env, "status", "nothere")
    assert "no cluster named 'nothere'" in _one_line_failure(done, seconds)


@pytest.mark.parametrize(("token", "says"), [(None, "requires its authentication token and none is set here"),
                                             ("wrong", "rejects the token in RAY_AUTH_TOKEN")])
def test_a_missing_or_wrong_token_is_one_line(token_head, tmp_path, token, says):
    root, _ = token_head
    env = _env(root, HOME=str(tmp_path), **({"RAY_AUTH_TOKEN": token} if token else {}))
    for command in ("status", "down"):
        done, seconds = _hybridlb(env, command, "nothere")
        assert says in _one_line_failure(done, seconds)


def test_stale_address_record_is_one_line(tmp_path):
    record = tmp_path / "ray" / "ray_current_cluster"
    record.parent.mkdir()
    record.write_text(f"127.0.0.1:{free_port()}")  # a cluster that is gone: nobody listens there
    for command in ("status", "down"):
        done, seconds = _hybridlb(_env(tmp_path), command, "default")
        output = _one_line_failure(done, seconds)
        assert str(record) in output and "stale address file" in output and "--address" in output


def test_detached_cluster_on_a_token_cluster(token_head, tiny_qwen3, tmp_path):
    """The README's path: `up --detach --address auto`, then the `status` / `down` it prints."""
    root, _ = token_head
    port = free_port()
    config = {"engine": {"model": tiny_qwen3, "max_model_len": 512, "kv_cache_gib": 0.05, "torch_threads": 1},
              "api": {"port": port}, "ray": {"name": "tokened"}}
    path = tmp_path / "tokened.yaml"
    path.write_text(yaml.safe_dump(config))
    env = _env(root)
    try:
        started, _ = _hybridlb(env, "up", str(path), "--detach", "--address", "auto", timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
        assert "hybridlb status tokened" in started.stdout and "gcs_client" not in started.stderr
        listed, seconds = _hybridlb(env, "status", "tokened")
        assert listed.returncode == 0 and seconds < 5, listed.stdout + listed.stderr
        assert "hybridlb:tokened:engine:0" in listed.stdout and "ALIVE" in listed.stdout
        assert "gcs_client" not in listed.stderr
    finally:
        stopped, _ = _hybridlb(env, "down", "tokened")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
