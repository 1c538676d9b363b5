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

import grpc
import ray

from hybridlb import lifecycle

log = logging.getLogger("hybridlb.up")


class UpError(RuntimeError):
    """The cluster cannot be placed or started; the message says why and what to change."""


def actor_name(cluster: str, role: str, index: int | str | None = None) -> str:
    return f"hybridlb:{cluster}:{role}" + ("" if index is None else f":{index}")


_ray_context = None  # what ray.init returned (its dashboard URL)


def connect(address: str | None, namespace: str, num_cpus: float | None = None) -> None:
    """Join the Ray cluster at ``address`` (as ``attach``), or start a private local one with at least
    ``num_cpus`` logical CPUs (Ray's unit of placement, not a thread count: engines set
    their torch threads themselves), so the config fits however many cores this machine has."""
    global _ray_context
    if ray.is_initialized():
        return
    if address:
        attach(address, namespace)
        return
    local = {"num_cpus": max(os.cpu_count() or 1, math.ceil(num_cpus or 0)), "include_dashboard": True}
    _ray_context = ray.init(address="local", namespace=namespace, log_to_driver=False, **local)


def ray_address_file() -> str:
    """Where ``ray start`` records the address of this machine's Ray cluster (Ray's own rule)."""
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(temp, "ray", "ray_current_cluster")


def attach(address: str | None, namespace: str) -> None:
    """Join a running Ray cluster: ``address``, else ``RAY_ADDRESS``, else the one ``ray start``
    recorded on this machine; with its token when it asks for one. UpError with one line saying why
    not (none running, a stale address file, the cluster's token missing or wrong), within seconds and
    never a Ray traceback: Ray's own join retries a refused connection for 20 s, a warning a second."""
    global _ray_context
    if ray.is_initialized():
        return
    address, source = _find_address(address)
    if "://" not in address:  # a Ray Client address (ray://) is Ray's own business
        _check_gcs(address, source)
    try:
        _ray_context = ray.init(address=address, namespace=namespace, log_to_driver=False,
                                logging_level=logging.ERROR)
    except Exception as exc:  # Ray raises many kinds here; the user needs one line, not its stack
        raise UpError(_attach_failure(address, exc)) from None


def _find_address(address: str | None) -> tuple[str, str]:
    """The cluster's address and where it came from (Ray's order: an explicit one, ``RAY_ADDRESS``,
    the file ``ray start`` writes)."""
    if address and address != "auto":
        return address, "--address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    if recorded := _recorded_address():
        return recorded, ray_address_file()
    raise UpError("no Ray cluster is running on this machine (nothing recorded in "
                  f"{ray_address_file()}): start one with `ray start --head`, or pass --address HOST:PORT; "
                  "a cluster `hybridlb up` started without --address is private to that command: ask its "
                  "API server with `hybridlb status --url http://127.0.0.1:8000`")


def _recorded_address() -> str | None:
    try:
        with open(ray_address_file()) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _check_gcs(address: str, source: str) -> None:
    """Ask the cluster's GCS directly, in a second or two, whether a join would succeed; take its
    token when it asks for one."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise UpError(f"{address!r} (from {source}) is not a Ray cluster's address: give HOST:PORT")
    if not _answers(host or "127.0.0.1", int(port)):
        if source in ("--address", "RAY_ADDRESS"):
            raise UpError(f"no Ray cluster answers at {address} (from {source})")
        raise UpError(f"no Ray cluster answers at {address}, the address recorded in {source}: a stale address "
                      "file, left by a cluster that is gone; pass --address HOST:PORT, or start a cluster with "
                      "`ray start --head` or `hybridlb up`")
    answer = _gcs_answer(address, {})
    if answer == grpc.StatusCode.UNAUTHENTICATED:
        _use_token(address)
    elif answer in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        raise UpError(f"something listens at {address} (from {source}), but not a Ray cluster's GCS "
                      f"({answer.name.lower()})")


def _answers(host: str, port: int) -> bool:
    """Whether anything accepts a TCP connection at host:port (a cluster that is gone does not)."""
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def _gcs_answer(address: str, headers: dict[str, str]) -> grpc.StatusCode:
    """How the GCS at ``address`` answers a request for its cluster id (the first thing a join asks)
    that carries ``headers``: OK, UNAUTHENTICATED (it wants a token, or another one), ..."""
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=2, metadata=tuple(headers.items()))
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _use_token(address: str) -> None:
    """The cluster at ``address`` wants a token: check ours against it, then join in token mode (Ray
    turns that on by itself only for a cluster it finds on its own, not for an address it is given)."""
    from ray._raylet import AuthenticationTokenLoader, Config
    from ray.exceptions import AuthenticationError

    try:
        headers = AuthenticationTokenLoader.instance().get_token_for_http_header(ignore_auth_mode=True)
    except AuthenticationError as exc:  # RAY_AUTH_TOKEN_PATH names a file that is not there
        raise UpError(f"the Ray cluster at {address} requires its token, and it cannot be read: "
                      f"{str(exc).split('. ')[0]}") from None
    if not headers:
        raise UpError(f"the Ray cluster at {address} requires its authentication token and none is set here: "
                      "copy what `ray get-auth-token` prints on its head node to ~/.ray/auth_token, or set "
                      "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, a file holding it)")
    if _gcs_answer(address, headers) == grpc.StatusCode.UNAUTHENTICATED:
        raise UpError(f"the Ray cluster at {address} rejects the token in {_token_source()}: it is another "
                      "cluster's; use the one `ray get-auth-token` prints on its head node")
    os.environ["RAY_AUTH_MODE"] = "token"  # for this process (and the dashboard line); Config re-reads it
    Config.initialize("")


def _token_source() -> str:
    """Where Ray takes its token from (its order)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"


def _attach_failure(address: str, exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
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
