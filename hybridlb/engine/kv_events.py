"""KV-cache events on a ZMQ PUB socket, in vLLM's wire format, for upstream balancers.

llm-d's precise prefix-cache scorer subscribes to every engine's events and learns which
pod holds which blocks. The format is vLLM's (``--kv-events-config``):

* three frames per message: the topic, a sequence number (8 bytes, big-endian, counting
  from 0), and a msgpack payload;
* the payload is an array ``[ts, [event, ...], data_parallel_rank]``; each event an array
  tagged with its type: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium]`` or ``["BlockRemoved", block_hashes, medium]`` (vLLM's
  ``AllBlocksCleared`` never happens here: the cache is only evicted block by block).
  Block hashes are unsigned 64-bit ints (``prefix_hash``).
  Fixed-length arrays suit every llm-d decoder (the older one needs exactly these fields);
* a replay ROUTER socket (``replay_endpoint``) answers ``[identity, b"", start_seq]`` with
  each buffered message from ``start_seq`` on, ``[identity, b"", seq, payload]``, then
  ``[identity, b"", 0xFF * 8, b""]``. A thread of its own serves it, at most
  ``REPLAYS_PER_S`` requests a second, so a replay (up to ``buffer_steps`` messages) never
  delays a step and a flood of requests costs the engine one core's sliver, not its loop.

Each data-parallel rank publishes on the configured port plus its rank. With no endpoint
configured the PUB binds loopback (``DEFAULT_ENDPOINT``), not every interface as vLLM's
default does: events carry prompt token ids. They are for llm-d's indexer, which speaks
plain ZMQ, so the cluster token's CURVE keys do not apply to them (docs/protocol.md).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque

import msgspec
import zmq

from hybridlb.config import KVEventsConfig
from hybridlb.engine.block_manager import Removed, Stored

log = logging.getLogger(__name__)
END_OF_REPLAY = b"\xff" * 8
REQUEST_LIMIT = 4096  # bytes: the largest frame a subscriber or a replay client may send (ZMQ_MAXMSGSIZE)
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # bound: loopback unless an endpoint is configured
REPLAYS_PER_S = 4.0  # replay requests served per second, at most (others wait in the ROUTER's queue)


class BlockStored(msgspec.Struct, array_like=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(msgspec.Struct, array_like=True, tag=True):
    block_hashes: list[int]
    medium: str | None


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


def rank_endpoint(endpoint: str, rank: int) -> str:
    """``endpoint`` for data-parallel rank ``rank``: a tcp port moves up by the rank (as vLLM's)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    match = re.fullmatch(r"(tcp://.*):(\d+)", endpoint)
    if match is None:
        return endpoint
    return f"{match.group(1)}:{int(match.group(2)) + rank}"


def binds_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local endpoint is bound, a remote address is dialled."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def to_wire(events: list[Stored | Removed], block_size: int, medium: str) -> list[BlockStored | BlockRemoved]:
    """Group the block manager's events as vLLM does: one BlockStored per run of chained
    blocks (a request's step), one BlockRemoved per run of evictions."""
    wire: list[BlockStored | BlockRemoved] = []
    for event in events:
        last = wire[-1] if wire else None
        if isinstance(event, Stored):
            if isinstance(last, BlockStored) and last.block_hashes[-1] == event.parent_hash:
                last.block_hashes.append(event.block_hash)
                last.token_ids += event.token_ids
            else:
                wire.append(BlockStored([event.block_hash], event.parent_hash, list(event.token_ids), block_size,
                                        None, medium))
        elif isinstance(last, BlockRemoved):
            last.block_hashes.append(event.block_hash)
        else:
            wire.append(BlockRemoved([event.block_hash], medium))
    return wire


class KVEventPublisher:
    """Publishes one batch per engine step that changed the cache."""

    def __init__(self, config: KVEventsConfig, context: zmq.Context, rank: int, block_size: int, medium: str):
        self.topic = config.topic.encode()
        self.rank, self.block_size, self.medium = rank, block_size, medium
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.lock = threading.Lock()  # the buffer: appended by the engine loop, read by the replay thread
        self.closing = threading.Event()
        self.replayer: threading.Thread | None = None
        self.encoder = msgspec.msgpack.Encoder()
        self.endpoint = rank_endpoint(config.endpoint or DEFAULT_ENDPOINT, rank)
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.set_hwm(config.hwm)
        self.socket.setsockopt(zmq.MAXMSGSIZE, REQUEST_LIMIT)  # what a PUB takes in: subscriptions
        binds = config.endpoint is None or binds_endpoint(self.endpoint)
        (self.socket.bind if binds else self.socket.connect)(self.endpoint)
        if config.replay_endpoint:
            replay = context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.setsockopt(zmq.MAXMSGSIZE, REQUEST_LIMIT)  # a replay request is an 8-byte number
            replay.bind(rank_endpoint(config.replay_endpoint, rank))
            self.replayer = threading.Thread(target=self._serve_replays, args=(replay,), name="kv-events-replay",
                                             daemon=True)
            self.replayer.start()
        log.info("engine %d publishes KV-cache events on %s (topic %r)", rank, self.endpoint, config.topic)

    def publish(self, events: list[Stored | Removed]) -> None:
        batch = KVEventBatch(time.time(), to_wire(events, self.block_size, self.medium), self.rank)
        self.send(batch)

    def send(self, batch: KVEventBatch) -> None:
        payload = self.encoder.encode(batch)
        seq = self.seq.to_bytes(8, "big")
        self.seq += 1
        with self.lock:
            self.buffer.append((self.seq - 1, payload))
        # PUB never blocks: past a subscriber's high-water mark it drops that subscriber's copy.
        self.socket.send_multipart((self.topic, seq, payload))

    def _serve_replays(self, replay: zmq.Socket) -> None:
        """The replay thread: answer each request from the buffer as it is now, at most
        ``REPLAYS_PER_S`` a second, until ``close``."""
        next_at = 0.0
        try:
            while not self.closing.is_set():
                if not replay.poll(200):
                    continue
                frames = replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    log.warning("dropped a malformed KV-event replay request (%d frames)", len(frames))
                    continue
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at = time.monotonic() + 1 / REPLAYS_PER_S
                identity, start = frames[0], int.from_bytes(frames[2], "big")
                with self.lock:
                    buffered = [(seq, payload) for seq, payload in self.buffer if seq >= start]
                for seq, payload in buffered:
                    replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
                replay.send_multipart((identity, b"", END_OF_REPLAY, b""))
        finally:
            replay.close(linger=0)

    def close(self) -> None:
        """Stop the replay thread (before the engine destroys the ZMQ context it shares)."""
        self.closing.set()
        if self.replayer is not None:
            self.replayer.join(timeout=2)
