"""Entry point of an API server process (``hybridlb:api:<node>``): the listening socket, the
uvicorn server and its orderly stop. The application itself is ``hybridlb.api.app``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import threading
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

import uvicorn

from hybridlb import lifecycle
from hybridlb.api.spec import ApiServerSpec
from hybridlb.config import Config


def listen(host: str, port: int, shared: bool) -> socket.socket:
    """A listening socket; ``shared`` lets several API server processes take the same
    port, the kernel spreading connections among them (SO_REUSEPORT). Lifts this
    process's open-files limit first: each client connection holds a descriptor."""
    lifecycle.raise_open_files_limit()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


class _Server(uvicorn.Server):
    """uvicorn, minus re-raising the signal that stopped it: SIGTERM or Ctrl-C (which the
    whole process group gets) is an orderly stop here, answered with a graceful shutdown
    and exit code 0, not a KeyboardInterrupt traceback. A stop closes the listening socket at
    once, then ends every in-flight request with an error (``on_stop``) after ``grace_s``
    (``api.shutdown_timeout_s``; the node keeps its engines serving meanwhile), at once without
    one: the node then stops its engines at the same time, so they could not finish, and a
    stream cut at the end of uvicorn's grace period would tell its client nothing."""

    def __init__(self, config: uvicorn.Config, on_stop=None, grace_s: float = 0.0):
        super().__init__(config)
        self.on_stop, self.grace_s = on_stop, grace_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def stop(self) -> None:
        """Ask the server to stop (from a signal handler or another thread)."""
        if self.should_exit:  # a repeated signal: the stop is under way
            return
        self.should_exit = True
        if self.on_stop is not None and self._loop is not None and not self._loop.is_closed():
            # api.shutdown_timeout_s: requests in flight may finish meanwhile (the node's engines serve on)
            self._loop.call_soon_threadsafe(self._loop.call_later, self.grace_s, self.on_stop)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # a Ray actor's thread
            yield
            return
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop(self, *_) -> None:
        self.stop()


def use_shared_metrics(directory: str | None) -> None:
    """Keep this process's metrics in ``directory``, shared with the node's other API server
    processes (``ApiServerSpec.metrics_dir``). The metrics library reads this once, when it is
    first imported: call it before ``hybridlb.api.app`` is."""
    if directory is not None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory


def make_server(app, config: Config, drains: bool = True) -> _Server:
    """The HTTP server of one API server, for ``serve``'s processes and Ray's actors alike;
    ``drains``: a stop lets requests in flight finish first (``api.shutdown_timeout_s``), as a
    ``serve`` node's does (``hybridlb down`` stops a Ray cluster's actors at once)."""
    grace = config.api.shutdown_timeout_s if drains else 0.0
    return _Server(uvicorn.Config(app, log_level=config.api.log_level, access_log=False, loop="uvloop",
                                  http="httptools", timeout_graceful_shutdown=grace + 3),
                   on_stop=app.state.stop_requests, grace_s=grace)


def run_api_server(config: Config, spec: ApiServerSpec, host: str, port: int, shared_port: bool = False,
                   ready: Event | None = None, sock: socket.socket | None = None, orders: Connection | None = None
                   ) -> None:
    """Serve HTTP on ``host:port`` over ``spec.engines`` until SIGTERM; set ``ready`` once
    every engine has answered (connections made before then wait in the backlog). ``sock``: that
    port's socket, already listening (``serve`` binds it before the engines load). ``orders``: the
    whole spec comes on it once the engines are up (``serve`` starts this process while they load)."""
    title = f"hybridlb:{spec.name}"
    lifecycle.set_title(title)
    lifecycle.configure_logging(title)
    lifecycle.die_with_parent()
    lifecycle.leave_interrupts_to_the_launcher()
    if sock is None:
        sock = listen(host, port, shared_port)  # first: from now on clients wait in the backlog, never refused
    else:
        lifecycle.raise_open_files_limit()  # as listen() does, in the process that accepts the connections
    use_shared_metrics(spec.metrics_dir)
    from hybridlb.api.app import create_app

    if orders is not None:
        try:
            spec = orders.recv()
        except EOFError:  # the node's start failed before its engines were up
            return
        orders.close()
    app = create_app(config, spec, on_ready=ready.set if ready is not None else None)
    make_server(app, config).run(sockets=[sock])
    gc.freeze()  # the interpreter's last collection would walk every object of its modules, for nothing
