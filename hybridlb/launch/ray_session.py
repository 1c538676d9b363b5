"""Joining and leaving Ray for ``hybridlb up / status / down``: a private local cluster or a running
one (found by ``--address``, ``RAY_ADDRESS`` or the address ``ray start`` recorded), with one-line
errors instead of Ray's tracebacks; the actors' names; waiting on actors while a stop may be asked
for; the dashboard's address."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable

import ray

from hybridlb import lifecycle

log = logging.getLogger("hybridlb.up")


class UpError(RuntimeError):
    """The cluster cannot be placed or started; the message says why and what to change."""


def actor_name(cluster: str, role: str, index: int | str | None = None) -> str:
    return f"hybridlb:{cluster}:{role}" + ("" if index is None else f":{index}")


_ray_context = None  # what ray.init returned (its dashboard URL)


def connect(address: str | None, namespace: str, num_cpus: float | None = None) -> None:
    """Join the Ray cluster at ``address``, or start a private local one with at least
    ``num_cpus`` logical CPUs (Ray's unit of placement, not a thread count: engines set
    their torch threads themselves), so the config fits however many cores this machine has."""
    global _ray_context
    if ray.is_initialized():
        return
    local = {}
    if not address:
        local = {"num_cpus": max(os.cpu_count() or 1, math.ceil(num_cpus or 0)), "include_dashboard": True}
    _ray_context = ray.init(address=address or "local", namespace=namespace, log_to_driver=False, **local)


def ray_address_file() -> str:
    """Where ``ray start`` records the address of this machine's Ray cluster (Ray's own rule)."""
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(temp, "ray", "ray_current_cluster")


def attach(address: str | None, namespace: str) -> None:
    """Join a running Ray cluster for ``status`` / ``down``: ``address``, else ``RAY_ADDRESS``, else
    the one ``ray start`` recorded on this machine. UpError with one line saying why not (none
    running, a stale address file, the cluster's token needed), never a Ray traceback."""
    if ray.is_initialized():
        return
    source = "--address"
    if not address:
        address, source = os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS"
    if not address or address == "auto":
        address, source = _recorded_address(), ray_address_file()
    if not address:
        raise UpError("no Ray cluster is running on this machine (nothing recorded in "
                      f"{ray_address_file()}); a cluster `hybridlb up` started without --address is private to "
                      "that command: ask its API server with `hybridlb status --url http://127.0.0.1:8000`")
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not _answers(host or "127.0.0.1", int(port)):
        stale = "" if source in ("--address", "RAY_ADDRESS") else \
            " (a stale address file, left by a cluster that is gone: ignored; remove it, or pass --address)"
        raise UpError(f"no Ray cluster answers at {address}, the address from {source}{stale}")
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:  # Ray raises many kinds here; the user needs one line, not its stack
        raise UpError(_attach_failure(address, exc)) from None


def _recorded_address() -> str | None:
    try:
        with open(ray_address_file()) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _answers(host: str, port: int) -> bool:
    """Whether anything accepts a TCP connection at host:port (a cluster that is gone does not)."""
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False


def _attach_failure(address: str, exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "authentication" in str(exc).lower() or "token" in str(exc).lower():
        return (f"the Ray cluster at {address} requires its authentication token: run this where `ray "
                "get-auth-token` prints it (~/.ray/auth_token), or set RAY_AUTH_TOKEN to it")
    return f"cannot join the Ray cluster at {address}: {type(exc).__name__}: {text[:300]}"


def wait_for(refs, timeout_s: float, check: Callable[[], None]):
    """``ray.get(refs)``, waiting in short slices and calling ``check()`` between them (it raises to
    give up: a stop asked for). A signal handler cannot raise out of Ray's own blocking wait, so a
    launcher that must stop mid start-up polls instead."""
    pending = refs if isinstance(refs, list) else [refs]
    deadline = time.monotonic() + timeout_s
    while True:
        _, waiting = ray.wait(pending, num_returns=len(pending), timeout=0.25)
        if not waiting:
            return ray.get(refs)
        check()
        if time.monotonic() > deadline:
            raise ray.exceptions.GetTimeoutError(f"not ready within {timeout_s:.0f} s")


def dashboard_line(private: bool) -> str:
    """Where the Ray dashboard is and how to open it (Ray asks for its token when token auth is on)."""
    url = getattr(_ray_context, "dashboard_url", None) or ""
    if not url:
        return "Ray dashboard: not running (start Ray with its dashboard to see the actors)"
    line = f"Ray dashboard: {url if url.startswith('http') else 'http://' + url}"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        line += (" - it asks for this cluster's token: `ray get-auth-token` prints it (it is kept in "
                 "~/.ray/auth_token)")
    return line + ("; it closes with this command" if private else "")


def kill_private() -> None:
    """Ctrl-C twice: SIGKILL the private Ray cluster (every process this driver started) now."""
    for pid in lifecycle.descendants():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def shutdown_private() -> None:
    """Stop the Ray cluster ``up`` started, and return only once its processes have exited."""
    ray_processes = lifecycle.descendants()
    ray.shutdown()
    if left := lifecycle.wait_gone(ray_processes, timeout_s=20):
        log.warning("%d processes of the local Ray cluster are still running: %s", len(left), left)
