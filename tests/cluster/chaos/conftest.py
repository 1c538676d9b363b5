"""One engine process, a chaos proxy in front of it and one API server process, per module."""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import dataclass

import httpx
import pytest

from hybridlb.api.http_server import run_api_server
from hybridlb.api.spec import ApiServerSpec
from hybridlb.config import ApiConfig, Config, EngineConfig
from hybridlb.engine.client import EngineClient
from hybridlb.engine.spawn import EngineProcess, start_engine, stop_engines, wait_until_ready
from hybridlb.testing.ports import free_port
from tests.cluster.chaos.wire import ChaosProxy

REQUEST_TIMEOUT_S = 4.0
_spawn = multiprocessing.get_context("spawn")


@dataclass
class Bench:
    engine: EngineProcess
    proxy: ChaosProxy
    api: multiprocessing.Process
    url: str
    model: str

    def engine_stats(self, timeout_s: float = 10.0):
        """The engine's own latest stats, read past the proxy."""
        client = EngineClient(self.engine.address)
        try:
            client.hello(timeout_s)
            while (batch := client.recv(timeout_s)) is not None:
                if batch.stats is not None:
                    return batch.stats
            raise TimeoutError("the engine sent no stats")
        finally:
            client.close()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def stall_api(self, seconds: float) -> None:
        """Stop the API server process for ``seconds`` (a GC pause, CPU starvation)."""
        import time

        os.kill(self.api.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(self.api.pid, signal.SIGCONT)


def start_bench(model: str, tmp_path, direct: bool = False, **engine) -> Bench:
    """``direct``: the API server talks to the engine itself (the proxy idles)."""
    engine_address = f"ipc://{tmp_path}/engine-0"
    settings = {"max_model_len": 2048, "num_kv_blocks": 1024, "dtype": "float32", **engine}
    process = start_engine(EngineConfig(model=model, **settings), rank=0, address=engine_address, torch_threads=1)
    proxy = ChaosProxy(engine_address, f"ipc://{tmp_path}/proxy-0")
    proxy.start()
    port = free_port()
    config = Config(engine=EngineConfig(model=model, **settings),
                    api=ApiConfig(port=port, request_timeout_s=REQUEST_TIMEOUT_S, max_concurrent_requests=64))
    ready = _spawn.Event()
    spec = ApiServerSpec(((0, engine_address if direct else proxy.address),))
    api = _spawn.Process(target=run_api_server, args=(config, spec, "127.0.0.1", port),
                         kwargs={"ready": ready}, daemon=True)
    try:
        wait_until_ready([process], timeout_s=120)
        api.start()
        assert ready.wait(120), "the API server did not become ready"
    except BaseException:
        stop_bench(Bench(process, proxy, api, "", model))
        raise
    return Bench(process, proxy, api, f"http://127.0.0.1:{port}", model)


def stop_bench(bench: Bench) -> None:
    if bench.api.pid is not None and bench.api.is_alive():
        os.kill(bench.api.pid, signal.SIGCONT)
        bench.api.terminate()
        bench.api.join(10)
        if bench.api.is_alive():
            bench.api.kill()
    bench.proxy.stop()
    stop_engines([bench.engine])


@pytest.fixture(scope="module")
def bench(tiny_qwen3, tmp_path_factory):
    started = start_bench(tiny_qwen3, tmp_path_factory.mktemp("chaos"))
    yield started
    stop_bench(started)


@pytest.fixture(scope="module")
def direct_bench(tiny_qwen3, tmp_path_factory):
    """No proxy in the way: its unlimited buffer would hide how the engine treats a slow reader."""
    started = start_bench(tiny_qwen3, tmp_path_factory.mktemp("direct"), direct=True)
    yield started
    stop_bench(started)
