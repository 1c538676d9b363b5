"""The engine as a real process, driven over its real ZMQ socket by a test client."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import zmq

from hybridlb import LLM, SamplingParams
from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.config import EngineConfig
from hybridlb.engine.client import EngineClient
from hybridlb.engine.spawn import EngineStartError, start_engine, stop_engines, wait_until_ready
from tests.conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_qwen3, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('ipc')}/engine-0"
    config = EngineConfig(model=tiny_qwen3, max_model_len=256, num_kv_blocks=64, dtype="float32")
    process = start_engine(config, rank=0, address=address, torch_threads=1)
    try:
        wait_until_ready([process], timeout_s=120)
        yield process
    finally:
        stop_engines([process])


@pytest.fixture
def client(engine):
    client = EngineClient(engine.address)
    client.hello(timeout_s=10)
    yield client
    client.close()


def _collect(client: EngineClient, count: int, stats: list | None = None):
    """Tokens and finish reasons of ``count`` requests; stats seen on the way go to ``stats``."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    while len(finished) < count:
        batch = client.recv(timeout_s=30)
        assert batch is not None, "engine stopped answering"
        if batch.stats and stats is not None:
            stats.append(batch.stats)
        for output in batch.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason:
                finished[output.request_id] = output.finish_reason
    return tokens, finished


def _ids(tiny_qwen3, prompts):
    tokenizer = Tokenizer(tiny_qwen3)
    return [tokenizer.encode(p) for p in prompts]


def test_same_tokens_as_the_offline_engine(tiny_qwen3, client):
    expected = LLM(tiny_qwen3, max_model_len=256, num_kv_blocks=64, dtype="float32").generate(PROMPTS, GREEDY)
    for i, ids in enumerate(_ids(tiny_qwen3, PROMPTS)):
        client.add(f"r{i}", ids, GREEDY)
    tokens, finished = _collect(client, len(PROMPTS))
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == [e.token_ids for e in expected]
    assert set(finished.values()) == {"length"}


def test_abort_frees_blocks_and_stats_report_it(tiny_qwen3, client):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i, ids in enumerate(_ids(tiny_qwen3, PROMPTS[:3])):
        client.add(f"a{i}", ids, long)
    busy = None
    while busy is None:
        batch = client.recv(timeout_s=30)
        if batch.stats and batch.stats.num_running == 3:
            busy = batch.stats
    assert busy.kv_usage > 0
    client.abort(["a0", "a1", "a2"])
    stats = []
    _, finished = _collect(client, 3, stats)
    assert finished == {"a0": "abort", "a1": "abort", "a2": "abort"}
    assert stats[-1].num_running == 0 and stats[-1].num_waiting == 0 and stats[-1].kv_usage == 0


def test_bad_frames_are_dropped_and_the_engine_keeps_serving(tiny_qwen3, engine, client):
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(engine.address)
    for frame in (b"", b"\xff\x00garbage", b"\x92\xa3add\x01", b"x" * 100_000):
        raw.send(frame)
    raw.send_multipart([b"two", b"frames"])
    raw.close(linger=1000)
    client.add("too-long", [5] * 400, GREEDY)
    client.add("ok", _ids(tiny_qwen3, ["GPU"])[0], GREEDY)
    tokens, finished = _collect(client, 2)
    assert finished == {"too-long": "error", "ok": "length"}
    assert len(tokens["ok"]) == 12


def test_process_title_names_the_rank(engine):
    cmdline = Path(f"/proc/{engine.process.pid}/cmdline").read_bytes()
    assert cmdline.startswith(b"hybridlb:engine:0")


def test_start_failure_carries_the_engine_error(tmp_path):
    config = EngineConfig(model=str(tmp_path / "missing"))
    process = start_engine(config, rank=3, address=f"ipc://{tmp_path}/bad", torch_threads=1)
    try:
        with pytest.raises(EngineStartError, match=r"engine 3 failed to start: CheckpointError: .*does not exist"):
            wait_until_ready([process], timeout_s=60)
    finally:
        stop_engines([process])


def test_sigterm_stops_the_engine_within_5s_leaving_no_children(tiny_qwen3, tmp_path):
    config = EngineConfig(model=tiny_qwen3, max_model_len=256, num_kv_blocks=64)
    process = start_engine(config, rank=1, address=f"ipc://{tmp_path}/sig", torch_threads=1)
    try:
        wait_until_ready([process], timeout_s=120)
        client = EngineClient(process.address)
        client.hello(10)
        client.add("busy", _ids(tiny_qwen3, ["GPU"])[0], SamplingParams(max_tokens=1000, ignore_eos=True))
        assert client.recv(10) is not None  # mid-generation
        pid = process.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        start = time.monotonic()
        os.kill(pid, 15)
        process.process.join(5)
        assert not process.process.is_alive(), "engine ignored SIGTERM for 5 s"
        assert time.monotonic() - start < 5
        assert process.process.exitcode == 0
        assert all(not Path(f"/proc/{child}").exists() for child in children)
        client.close()
    finally:
        stop_engines([process])


def test_outputs_go_to_the_sender_and_a_reused_id_is_refused(tiny_qwen3, engine, client):
    other = EngineClient(engine.address)
    other.hello(10)
    try:
        ids = _ids(tiny_qwen3, ["GPU"])[0]
        client.add("shared", ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        other.add("shared", ids, GREEDY)
        other.add("mine", ids, GREEDY)
        theirs, their_finishes = _collect(other, 2)
        assert their_finishes == {"shared": "error", "mine": "length"}
        assert len(theirs["mine"]) == 12
        tokens, finished = _collect(client, 1)
        assert finished == {"shared": "length"} and len(tokens["shared"]) == 30
    finally:
        other.close()
