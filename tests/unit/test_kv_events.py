"""KV-cache events from a real engine process, read the way llm-d's subscriber reads them:
a SUB socket bound where the engine dials, three frames, plain msgpack arrays."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from hybridlb.config import EngineConfig, KVEventsConfig
from hybridlb.engine.kv_events import END_OF_REPLAY, rank_endpoint
from hybridlb.testing.ports import free_port

BLOCK = 16


class Subscriber(threading.Thread):
    """llm-d's side: a SUB socket bound where engines dial, always receiving (a bound SUB only
    sends its subscription to a connecting PUB while its owner polls it, a libzmq quirk)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's topic filter
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.received: list[list[bytes]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if self.sub.poll(50):
                self.received.append(self.sub.recv_multipart())
        self.sub.close(linger=0)

    def messages(self, settle_s: float = 1.0) -> list[list[bytes]]:
        """What arrived, once nothing new came for ``settle_s``."""
        count = -1
        while count != len(self.received):
            count = len(self.received)
            time.sleep(settle_s)
        return list(self.received)


@pytest.fixture
def subscriber():
    listener = Subscriber()
    listener.start()
    yield listener
    listener.done.set()
    listener.join(timeout=5)


def test_data_parallel_ranks_publish_on_consecutive_ports():
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert rank_endpoint("tcp://indexer.svc:5557", 1) == "tcp://indexer.svc:5558"
    assert rank_endpoint("inproc://events", 2) == "inproc://events_dp2"


def test_kv_events_need_prefix_caching(tiny_qwen3):
    with pytest.raises(ValueError, match="prefix_caching is false"):
        EngineConfig(model=tiny_qwen3, prefix_caching=False, kv_events={"enable_kv_cache_events": True})


def test_an_unset_endpoint_binds_loopback_and_replays_come_from_their_own_thread():
    """No endpoint: the PUB binds 127.0.0.1 (events carry prompt token ids), not every interface.
    A replay is answered while the engine's loop does nothing but publish, and requests are
    served at most REPLAYS_PER_S a second, however fast they come."""
    from hybridlb.engine.block_manager import Stored
    from hybridlb.engine.kv_events import DEFAULT_ENDPOINT, REPLAYS_PER_S, KVEventPublisher

    context = zmq.Context()
    rank = 40 + free_port() % 200  # the default port plus the rank: clear of a real 5557
    replay_port = free_port() - rank
    config = KVEventsConfig(enable_kv_cache_events=True, replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    publisher = KVEventPublisher(config, context, rank, BLOCK, "CPU")
    client = context.socket(zmq.DEALER)
    try:
        assert publisher.socket.getsockopt_string(zmq.LAST_ENDPOINT) == rank_endpoint(DEFAULT_ENDPOINT, rank)
        assert DEFAULT_ENDPOINT.startswith("tcp://127.0.0.1:")
        for index in range(50):
            publisher.publish([Stored(index + 1, index or None, [index] * BLOCK)])
        client.connect(rank_endpoint(config.replay_endpoint, rank))  # the port plus the rank
        started = time.monotonic()
        ends = []
        for _ in range(3):
            client.send_multipart([b"", (45).to_bytes(8, "big")])
        while len(ends) < 3:
            assert client.poll(5000), "no replay answer"
            frames = client.recv_multipart()
            if frames[1] == END_OF_REPLAY:
                ends.append(time.monotonic() - started)
            else:
                assert int.from_bytes(frames[1], "big") >= 45
        assert ends[2] - ends[0] >= 2 / REPLAYS_PER_S * 0.9, ends
    finally:
        client.close(linger=0)
        publisher.close()
        context.destroy(linger=0)
