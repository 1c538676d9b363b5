"""``hybridlb serve``: one node's process tree, no Ray.

The parent process (``hybridlb:serve``) starts the engines, waits for each one's
readiness handshake, starts the API server, waits until its /health answers 200, prints
the URL, then waits. SIGTERM or Ctrl-C stops the API server first (no new requests),
then the engines. If the API server dies the node stops; a dead engine is reported by
/health while the rest keeps serving.
"""

from __future__ import annotations

import logging
import multiprocessing
import tempfile
import time
import urllib.error
import urllib.request
from multiprocessing.connection import wait

from hybridlb import lifecycle
from hybridlb.api.server import run_api_server
from hybridlb.config import Config
from hybridlb.engine.launch import (
    EngineProcess,
    EngineStartError,
    default_torch_threads,
    start_engine,
    stop_engines,
    wait_until_ready,
)

log = logging.getLogger("hybridlb.serve")
_spawn = multiprocessing.get_context("spawn")


class NodeStartError(RuntimeError):
    """A component of this node failed to start; the message says which and why."""


def _wait_healthy(url: str, process: multiprocessing.Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process.is_alive():
            raise NodeStartError(f"the API server exited with code {process.exitcode} (see its log above)")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise NodeStartError(f"the API server at {url} was not healthy after {timeout_s:.0f} s")


class Node:
    """The processes of one node and how to start and stop them."""

    def __init__(self, config: Config):
        self.config = config
        self.runtime_dir = tempfile.mkdtemp(prefix="hybridlb-")
        self.engines: list[EngineProcess] = []
        self.api: multiprocessing.Process | None = None
        self.stopping = False

    @property
    def url(self) -> str:
        return f"http://{self.config.api.host}:{self.config.api.port}"

    def start(self, ranks: list[int], timeout_s: float = 600) -> None:
        threads = default_torch_threads(self.config.engine, len(ranks))
        for rank in ranks:
            address = f"ipc://{self.runtime_dir}/engine-{rank}"
            self.engines.append(start_engine(self.config.engine, rank, address, threads))
        try:
            wait_until_ready(self.engines, timeout_s)
        except EngineStartError as exc:
            raise NodeStartError(str(exc)) from None
        addresses = [(e.rank, e.address) for e in self.engines]
        self.api = _spawn.Process(target=run_api_server, args=(self.config, addresses, 0),
                                  name="hybridlb:api:0", daemon=True)
        self.api.start()
        _wait_healthy(self.url, self.api, timeout_s=60)

    def wait(self) -> int:
        """Block until asked to stop or the API server dies; return the exit code."""
        watched = {e.process.sentinel: f"engine {e.rank}" for e in self.engines}
        while not self.stopping:
            if not self.api.is_alive():
                log.error("the API server exited with code %s; stopping the node", self.api.exitcode)
                return 1
            for sentinel in wait(list(watched), timeout=0.5):
                log.error("%s exited; /health now reports it", watched.pop(sentinel))
        return 0

    def stop(self) -> None:
        if self.api is not None and self.api.is_alive():
            self.api.terminate()
            self.api.join(5)
            if self.api.is_alive():
                self.api.kill()
        stop_engines(self.engines)


def serve(config: Config) -> int:
    """Run this node until SIGTERM / Ctrl-C; return the process exit code."""
    lifecycle.set_title("hybridlb:serve")
    lifecycle.configure_logging("hybridlb:serve")
    node = Node(config)

    def terminate() -> None:
        node.stopping = True
        if node.api is None:  # still starting: interrupt whatever start-up is waiting on
            raise NodeStartError("interrupted while starting")

    lifecycle.on_terminate(terminate)
    try:
        node.start(ranks=[0])
        log.info("serving %s at %s", config.served_model_name, node.url)
        print(f"hybridlb is ready: {node.url}/v1 (model {config.served_model_name!r})", flush=True)
        return node.wait()
    except NodeStartError as exc:
        log.error("%s", exc)
        return 1
    finally:
        node.stop()
