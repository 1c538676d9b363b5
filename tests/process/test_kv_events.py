"""KV-cache events from a real engine process, read the way llm-d's subscriber reads them:
a SUB socket bound where the engine dials, three frames, plain msgpack arrays."""

# ruff: noqa: F811 - the fixtures imported from this file's unit-tier half are parameters here
from __future__ import annotations

import msgspec
import zmq

from hybridlb import SamplingParams
from hybridlb.config import EngineConfig, KVEventsConfig
from hybridlb.engine.client import EngineClient
from hybridlb.engine.kv_events import END_OF_REPLAY
from hybridlb.engine.spawn import start_engine, stop_engines, wait_until_ready
from hybridlb.prefix_hash import block_hashes, hash_seed
from hybridlb.testing.ports import free_port
from hybridlb.testing.sockets import assert_drops_oversized
from tests.unit.test_kv_events import BLOCK, Subscriber, subscriber  # noqa: F401 - fixtures: subscriber

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _engine(model: str, tmp_path, subscriber: Subscriber, topic: str, num_kv_blocks: int, replay_port: int):
    """An engine process publishing its KV-cache events to ``subscriber``, and a client of it."""
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{subscriber.port}",
                            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic=topic)
    config = EngineConfig(model=model, max_model_len=256, num_kv_blocks=num_kv_blocks, dtype="float32",
                          block_size=BLOCK, kv_events=events)
    process = start_engine(config, rank=0, address=f"ipc://{tmp_path}/engine", torch_threads=1)
    return process, EngineClient(process.address)


def test_block_events_mirror_the_engine_cache(tiny_qwen3, tmp_path, subscriber):
    process, client = _engine(tiny_qwen3, tmp_path, subscriber, "kv@pod-a@tiny", 20, free_port())
    try:
        wait_until_ready([process], timeout_s=120)
        client.hello(timeout_s=10)
        prompts = [[(37 * p + 11 * k) % 1000 + 10 for k in range(100)] for p in range(4)]
        evicted = set()
        for index, prompt in enumerate(prompts):  # 6 full blocks each: the 20-block pool must evict
            client.add(f"r{index}", prompt, PARAMS)
            while True:
                batch = client.recv(timeout_s=30)
                assert batch is not None
                evicted |= set(batch.evicted)
                if any(o.finish_reason for o in batch.outputs):
                    break
        messages = subscriber.messages()
    finally:
        client.close()
        stop_engines([process])

    assert messages, "no KV-cache events arrived"
    assert all(len(frames) == 3 and frames[0] == b"kv@pod-a@tiny" for frames in messages)
    assert [int.from_bytes(f[1], "big") for f in messages] == list(range(len(messages)))
    mirror, stored, removed = {}, [], set()
    for frames in messages:
        ts, batch_events, rank = msgspec.msgpack.decode(frames[2])
        assert isinstance(ts, float) and rank == 0
        for event in batch_events:
            if event[0] == "BlockStored":
                assert len(event) == 7  # tag + the six fields every llm-d decoder reads
                _, hashes, parent, tokens, block_size, lora_id, medium = event
                assert block_size == BLOCK and lora_id is None and medium == "CPU"
                assert len(tokens) == BLOCK * len(hashes)
                assert parent is None or parent in mirror
                for i, block_hash in enumerate(hashes):
                    mirror[block_hash] = tokens[i * BLOCK : (i + 1) * BLOCK]
                    stored.append(block_hash)
            else:
                assert event[0] == "BlockRemoved" and event[2] == "CPU"
                for block_hash in event[1]:
                    assert mirror.pop(block_hash, None) is not None, "removed a block never stored"
                    removed.add(block_hash)
    seed = hash_seed(tiny_qwen3)
    expected = [h for prompt in prompts for h in block_hashes(prompt, BLOCK, seed)]
    assert stored == expected  # every full prompt block, hashed as the API server hashes it
    assert removed and removed == evicted  # the front end heard of the same evictions
    assert len(mirror) <= 20
    assert set(block_hashes(prompts[-1], BLOCK, seed)) <= set(mirror)  # the newest prompt is still cached


def test_replay_resends_from_a_sequence_number(tiny_qwen3, tmp_path, subscriber):
    replay_port = free_port()
    process, client = _engine(tiny_qwen3, tmp_path, subscriber, "kv@pod-b@tiny", 64, replay_port)
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    try:
        wait_until_ready([process], timeout_s=120)
        client.hello(timeout_s=10)
        for index in range(3):  # one after another: each step that stores blocks is one message
            client.add(f"r{index}", [index + 5] * 40, PARAMS)
            while not any(o.finish_reason for o in client.recv(timeout_s=30).outputs):
                pass
        live = subscriber.messages()
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = []
        while True:
            assert replay.poll(5000), "no replay answer"
            frames = replay.recv_multipart()
            if frames[1] == END_OF_REPLAY:
                assert frames[2] == b""
                break
            replies.append(frames)
        assert_drops_oversized(replay, "the replay socket", [b""])
    finally:
        replay.close(linger=0)
        client.close()
        stop_engines([process])
    assert len(live) >= 3
    assert [(f[1], f[2]) for f in replies] == [(f[1], f[2]) for f in live[1:]]
