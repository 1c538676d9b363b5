"""A ``serve`` node's API server processes: spawned while the node's engines load (their imports
take most of a second, which then costs nothing), handed their whole spec once every rank is up,
and spawned again with the same arguments when one dies (``Node._api_died``)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable

from hybridlb import lifecycle
from hybridlb.api.http_server import run_api_server
from hybridlb.api.spec import ApiServerSpec
from hybridlb.config import Config
from hybridlb.plan import NodePlan

_spawn = multiprocessing.get_context("spawn")


class NodeStartError(RuntimeError):
    """A component of this node failed to start; the message says which and why."""


class ApiProcesses:
    """The API server processes of one node (none when it is headless)."""

    def __init__(self, config: Config, node: NodePlan, runtime_dir: str, sockets: dict):
        self.config, self.node = config, node
        self.sockets = sockets  # API server name → its listening socket, until handed to its process
        self.processes: list[multiprocessing.Process] = []
        self.args: list[tuple] = []  # per process: what it was started with (a restart gets the same)
        self._waiting: list[tuple] = []  # while starting: (its plan, its ready event, the pipe its spec goes on)
        ports = [api.port for api in node.api_servers]
        # A shared port: one /metrics for all of them (see ApiServerSpec.metrics_dir).
        self.metrics_dir = os.path.join(runtime_dir, "metrics") if len(ports) > len(set(ports)) else None
        self.shared_port = {api.name: ports.count(api.port) > 1 for api in node.api_servers}

    def spawn(self) -> None:
        """Start every process; each loads its modules and waits for its spec (``start``)."""
        for api in self.node.api_servers:
            self.args.append((self.config, ApiServerSpec((), api.name, metrics_dir=self.metrics_dir), api.host,
                              api.port, self.shared_port[api.name]))
            ready, (orders, order) = _spawn.Event(), _spawn.Pipe(duplex=False)
            self.processes.append(self._process(len(self.processes), ready, orders))
            orders.close()
            self._waiting.append((api, ready, order))

    def start(self, specs: list[ApiServerSpec], timeout_s: float, stopping: Callable[[], bool]) -> None:
        """Hand each process its spec (``spawn`` first); return once every one is ready."""
        for index, ((_, _, order), spec) in enumerate(zip(self._waiting, specs, strict=True)):
            config, _, *rest = self.args[index]
            self.args[index] = (config, spec, *rest)
            with contextlib.suppress(OSError):  # one that died is named below
                order.send(spec)
            order.close()
        deadline = time.monotonic() + timeout_s
        for (api, ready, _), process in zip(self._waiting, self.processes, strict=True):
            while not ready.wait(0.2):
                if not process.is_alive():
                    raise NodeStartError(f"API server {api.name} exited with code {process.exitcode} "
                                         "(see its log above)")
                if time.monotonic() > deadline or stopping():
                    raise NodeStartError(f"API server {api.name} was not ready in time")
        self._waiting.clear()

    def respawn(self, index: int) -> multiprocessing.Process:
        """Start process ``index`` again, as it was started (it binds its port again)."""
        self.processes[index] = self._process(index)
        return self.processes[index]

    def pid_of(self, rank: int) -> int | None:
        """The process of the API server fronting ``rank`` first (multi-port: its only rank)."""
        for process, (_, spec, *_) in zip(self.processes, self.args, strict=False):
            if spec.engines and spec.engines[0][0] == rank:
                return process.pid
        return None

    def _process(self, index: int, ready=None, orders=None) -> multiprocessing.Process:
        config, spec, host, port, shared = self.args[index]
        sock = self.sockets.pop(spec.name, None)  # None: a restart, which binds the port again
        process = _spawn.Process(target=run_api_server, name=f"hybridlb:{spec.name}", daemon=True,
                                 args=(config, spec, host, port, shared, ready, sock, orders))
        with lifecycle.spawning():
            process.start()
        if sock is not None:
            sock.close()  # the API server holds it now
        return process
