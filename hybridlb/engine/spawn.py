"""Start engine processes, wait for their readiness handshake, stop them."""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from hybridlb import lifecycle
from hybridlb.config import EngineConfig
from hybridlb.engine.client import EngineClient
from hybridlb.engine.core_share import SharedCores, shared_cores
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.shell import run_engine
from hybridlb.protocol import EngineReady

_spawn = multiprocessing.get_context("spawn")
# Engines that run a model are forked from a server that imported torch once (hybridlb.engine.preload).
_forks = multiprocessing.get_context("forkserver")
_forks.set_forkserver_preload(["hybridlb.engine.preload"])


class EngineStartError(RuntimeError):
    """An engine process failed to come up; the message carries its own error."""


@dataclass
class EngineProcess:
    rank: int
    address: str
    process: multiprocessing.Process
    errors: Connection

    def failure(self) -> str | None:
        """Why the process died during start-up, or None while it is alive."""
        if self.errors.poll():
            try:
                return self.errors.recv()
            except EOFError:  # the child closed the pipe without a message: it died
                self.process.join(1)
        if not self.process.is_alive():
            return f"exited with code {self.process.exitcode}"
        return None


def default_torch_threads(config: EngineConfig, local_engines: int) -> int:
    """Split this machine's cores among the engines on it, at least one each.

    From 4 cores up one core is left to the API server(s) and coordinator: an engine's
    intra-op thread that gets preempted stalls its whole parallel region (measured on 2
    cores: HTTP throughput 0.86 of direct with every core given to the engine, 1.00 with
    one left free), while on a larger machine one core less costs the engine little.
    """
    if config.torch_threads:
        return config.torch_threads
    return max(1, engine_cores() // local_engines)


def engine_cores() -> int:
    """The cores a node gives its engines (all of them, but one from 4 up: see above)."""
    cores = os.cpu_count() or 1
    return cores - (1 if cores >= 4 else 0)


def node_core_share(config: EngineConfig, directory: str, name: str, slots: int,
                    pool: int | None = None, table: int = 0) -> list[SharedCores | None]:
    """Per local engine, the ``pool`` cores (default: ``engine_cores()``) it shares with its
    siblings (``hybridlb.engine.core_share``): none where ``torch_threads`` is set, as the
    user then chose each engine's threads. ``table``: slots to make room for beyond ``slots``
    (a node that may grow: its new engines share the same cores)."""
    if config.torch_threads or not config.share_cores:
        return [None] * slots
    size = max(slots, table)
    return [shared_cores(directory, name, slot, size, pool or engine_cores()) for slot in range(slots)]


def start_engine(config: EngineConfig, rank: int, address: str, torch_threads: int,
                 dp: DPContext | None = None, cores: SharedCores | None = None) -> EngineProcess:
    """Spawn the engine of ``rank``; ``dp`` says how it fits in the cluster (default: alone),
    ``cores`` which cores it may borrow from idle siblings (default: none)."""
    dp = dp or DPContext(rank=rank)
    context = _spawn if config.simulate is not None else _forks
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(
        target=run_engine, args=(config, dp, address, torch_threads, writer, cores),
        name=f"hybridlb:engine:{rank}", daemon=True,
    )
    with lifecycle.spawning():
        process.start()
    writer.close()
    return EngineProcess(rank, address, process, reader)


def wait_until_ready(engines: list[EngineProcess], timeout_s: float = 300.0,
                     token: str | None = None) -> list[EngineReady]:
    """Handshake with every engine; raise EngineStartError naming any that failed."""
    deadline = time.monotonic() + timeout_s
    ready = []
    for engine in engines:
        client = EngineClient(engine.address, client_id=f"launcher-{os.getpid()}-{engine.rank}", token=token)
        client.send_hello()
        try:
            while True:
                try:
                    ready.append(client.wait_ready(timeout_s=0.5))
                    break
                except TimeoutError:
                    failure = engine.failure()
                    if failure:
                        raise EngineStartError(f"engine {engine.rank} failed to start: {failure}") from None
                    if time.monotonic() > deadline:
                        raise EngineStartError(
                            f"engine {engine.rank} not ready after {timeout_s:.0f} s") from None
        finally:
            client.close()
    return ready


def stop_engines(engines: list[EngineProcess], timeout_s: float = 5.0) -> None:
    """SIGTERM every engine, then SIGKILL whatever has not exited by ``timeout_s``."""
    for engine in engines:
        if engine.process.is_alive():
            engine.process.terminate()
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        engine.process.join(max(0.0, deadline - time.monotonic()))
        if engine.process.is_alive():
            engine.process.kill()
            engine.process.join()
