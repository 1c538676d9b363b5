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
  ``[identity, b"", 0xFF * 8, b""]``.

Each data-parallel rank publishes on the configured port plus its rank.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque

import msgspec
import zmq

from hybridlb.config import KVEventsConfig
from hybridlb.engine.block_manager import Removed, Stored

log = logging.getLogger(__name__)
END_OF_REPLAY = b"\xff" * 8
REQUEST_LIMIT = 4096  # bytes: the largest frame a subscriber or a replay client may send (ZMQ_MAXMSGSIZE)


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


def _binds(endpoint: str) -> bool:
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
        self.encoder = msgspec.msgpack.Encoder()
        self.endpoint = rank_endpoint(config.endpoint, rank)
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.set_hwm(config.hwm)
        self.socket.setsockopt(zmq.MAXMSGSIZE, REQUEST_LIMIT)  # what a PUB takes in: subscriptions
        (self.socket.bind if _binds(self.endpoint) else self.socket.connect)(self.endpoint)
        self.replay = None
        if config.replay_endpoint:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.setsockopt(zmq.MAXMSGSIZE, REQUEST_LIMIT)  # a replay request is an 8-byte number
            self.replay.bind(rank_endpoint(config.replay_endpoint, rank))
        log.info("engine %d publishes KV-cache events on %s (topic %r)", rank, self.endpoint, config.topic)

    def publish(self, events: list[Stored | Removed]) -> None:
        batch = KVEventBatch(time.time(), to_wire(events, self.block_size, self.medium), self.rank)
        self.send(batch)

    def send(self, batch: KVEventBatch) -> None:
        payload = self.encoder.encode(batch)
        seq = self.seq.to_bytes(8, "big")
        self.seq += 1
        self.buffer.append((self.seq - 1, payload))
        # PUB never blocks: past a subscriber's high-water mark it drops that subscriber's copy.
        self.socket.send_multipart((self.topic, seq, payload))

    def serve_replay(self) -> None:
        """Answer pending replay requests (called from the engine's loop, never blocks)."""
        while self.replay is not None and self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("dropped a malformed KV-event replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    self.replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((identity, b"", END_OF_REPLAY, b""))
