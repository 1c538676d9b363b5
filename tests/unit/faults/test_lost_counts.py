"""How the API server counts the requests an engine's failure takes off it (unit tier: the
real pool, runner, metrics and ``EngineConnection.fail_all`` over two fake engines the test
drives): each request counts once, as migrated when it goes on elsewhere, as lost only when
its client gets the error (a failed migration, a quarantine, a pinned request), and neither
when its client had gone; then one log line tallies them."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from hybridlb.api.dispatch.engine_client import EngineConnection, EngineUnavailable
from hybridlb.api.dispatch.metrics import Metrics
from hybridlb.api.dispatch.pool import EnginePool
from hybridlb.api.dispatch.runner import RequestRunner
from hybridlb.api.errors import APIError
from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.params import SamplingParams
from hybridlb.protocol import RequestOutput

PARAMS = SamplingParams(max_tokens=8)


class FakeEngine:
    """An engine connection as the pool and the runner see it; ``die`` is the real ``fail_all``."""

    def __init__(self, rank: int, on_lost):
        self.rank, self.alive, self.on_lost = rank, True, on_lost
        self.draining = False
        self.info = SimpleNamespace(dp_group=False, max_model_len=512)
        self.prefix, self.queue_full, self.score = None, False, 0
        self.streams: dict[str, asyncio.Queue] = {}
        self.prefilling: dict[str, int] = {}
        self.budgets: dict[str, int] = {}
        self.resumed: dict[str, list[int]] = {}

    def add(self, request_id, prompt_ids, params, wave=0, cached_tokens=0, resumed=None) -> asyncio.Queue:
        if not self.alive:
            raise EngineUnavailable(f"engine {self.rank} is not available")
        self.resumed[request_id] = list(resumed or [])
        queue = self.streams[request_id] = asyncio.Queue()
        return queue

    def cached_tokens(self, hashes) -> int:
        return 0

    def release(self, request_id: str, abort: bool) -> None:
        self.streams.pop(request_id, None)

    def _send(self, message) -> None:
        pass

    def emit(self, finish: str | None = None) -> None:
        for request_id, queue in self.streams.items():
            queue.put_nowait(RequestOutput(request_id, [11], finish))

    def die(self) -> None:
        EngineConnection.fail_all(self, f"engine {self.rank} disconnected", "engine_down")
        self.alive = False


class Node:
    """Two fake engines under the real pool, runner and metrics."""

    def __init__(self, tokenizer: Tokenizer, migration_limit: int = 3):
        self.metrics = Metrics("m")
        self.engines = [FakeEngine(rank, self.metrics.lost_requests) for rank in (0, 1)]
        pool = EnginePool(self.engines, policy="round_robin")
        self.runner = RequestRunner(pool, tokenizer, self.metrics, migration_limit=migration_limit)

    def count(self, family: str, **labels: str) -> float:
        return sum(s.value for m in self.metrics.registry.collect() if m.name == family for s in m.samples
                   if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))

    def counts(self) -> tuple[float, float, float]:
        """(migrated, lost, quarantined) requests."""
        return (self.count("hybridlb:migrated_requests"), self.count("hybridlb:lost_requests"),
                self.count("hybridlb:quarantined_requests"))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _first_delta(node: Node, rank: int | None = None):
    stream = node.runner.generate("r", [1, 2, 3], PARAMS, rank)
    await anext(stream)  # streamed once: a failure now is a migration
    return stream


async def _streaming_on_engine_0(node: Node):
    """A request that got its first token from engine 0: its stream."""
    next_delta = asyncio.ensure_future(_first_delta(node))
    await _settle()
    node.engines[0].emit()
    return await next_delta


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


def _run(scenario):
    return asyncio.run(scenario())


def test_a_moved_request_counts_as_migrated_once_and_not_lost(tokenizer, caplog):
    node = Node(tokenizer)

    async def scenario():
        e0, e1 = node.engines
        stream = await _streaming_on_engine_0(node)
        e0.die()
        after = asyncio.ensure_future(anext(stream))
        await _settle()
        assert e1.resumed == {"r~1": [11]}  # it went on on engine 1 with the token it had
        e1.emit("length")
        assert (await after).finish_reason == "length"

    caplog.set_level(logging.DEBUG)
    _run(scenario)
    assert node.counts() == (1, 0, 0)
    assert node.count("hybridlb:migrated_requests", engine="0") == 1
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == ["engine 0 disconnected: moving its 1 in-flight requests to other engines (failing any that "
                     "cannot move)", "engine 0: of its 1 in-flight requests, 1 moved, 0 lost"]


def test_a_request_not_started_yet_moves_and_a_pinned_one_is_lost(tokenizer):
    node = Node(tokenizer)

    async def scenario():
        e0, e1 = node.engines
        free = asyncio.ensure_future(anext(node.runner.generate("free", [1, 2], PARAMS)))
        pinned = asyncio.ensure_future(anext(node.runner.generate("pinned", [1, 2], PARAMS, rank=0)))
        await _settle()
        assert set(e0.streams) == {"free", "pinned"}
        e0.die()
        await _settle()
        e1.emit("length")
        assert (await free).finish_reason == "length"
        with pytest.raises(APIError) as lost:
            await pinned
        assert lost.value.status == 503

    _run(scenario)
    assert node.counts() == (1, 1, 0)
    assert node.count("hybridlb:lost_requests", engine="0", reason="engine_down") == 1


def test_a_failed_migration_is_lost_once_and_not_migrated(tokenizer, caplog):
    node = Node(tokenizer, migration_limit=0)

    async def scenario():
        e0, _ = node.engines
        stream = await _streaming_on_engine_0(node)
        e0.die()
        with pytest.raises(APIError):
            await anext(stream)

    caplog.set_level(logging.WARNING)
    _run(scenario)
    assert node.counts() == (0, 1, 0)
    assert caplog.records[-1].levelno == logging.ERROR
    assert caplog.records[-1].getMessage() == "engine 0: of its 1 in-flight requests, 0 moved, 1 lost"


def test_a_quarantined_request_is_migrated_once_then_lost_once(tokenizer):
    node = Node(tokenizer)

    async def scenario():
        e0, e1 = node.engines
        stream = await _streaming_on_engine_0(node)
        e0.die()  # it moves to engine 1 ...
        after = asyncio.ensure_future(anext(stream))
        await _settle()
        e1.die()  # ... which dies under it too: quarantined, not sent again
        with pytest.raises(APIError) as failed:
            await after
        assert failed.value.code == "quarantined"

    _run(scenario)
    assert node.counts() == (1, 1, 1)
    assert node.count("hybridlb:lost_requests", engine="1", reason="engine_down") == 1


def test_a_request_whose_client_had_gone_is_neither_moved_nor_lost(tokenizer, caplog):
    node = Node(tokenizer)

    async def scenario():
        e0, _ = node.engines
        stream = await _streaming_on_engine_0(node)
        e0.die()  # its failure waits on the queue while the client ...
        await stream.aclose()  # ... goes away without reading further

    caplog.set_level(logging.WARNING)
    _run(scenario)
    assert node.counts() == (0, 0, 0)
    assert caplog.records[-1].getMessage() == ("engine 0: of its 1 in-flight requests, 0 moved, 0 lost, 1 whose "
                                               "client had gone")
