"""The coordinator's bookkeeping over real (ipc) sockets: freshness, lost ranks, wave repeats."""

from __future__ import annotations

import time

import pytest
import zmq

from hybridlb import coordinator as coordinator_module
from hybridlb.coordinator import Coordinator
from hybridlb.protocol import EngineStats, StartWave, encoder, to_engine_decoder


@pytest.fixture
def coordinator(tmp_path):
    c = Coordinator(f"ipc://{tmp_path}/stats", f"ipc://{tmp_path}/loads", 3, f"ipc://{tmp_path}/waves")
    yield c
    c.context.destroy(linger=0)


def _stats(rank: int, seq: int, epoch: int, running: int = 0) -> EngineStats:
    return EngineStats(rank=rank, num_running=running, num_waiting=0, kv_usage=0.0, seq=seq, epoch=epoch)


def test_a_restarted_engine_is_newer_despite_a_lower_seq(coordinator):
    coordinator.receive(encoder.encode(_stats(0, seq=50, epoch=1, running=7)))
    coordinator.receive(encoder.encode(_stats(0, seq=3, epoch=1, running=1)))  # stale: ignored
    assert coordinator.latest[0].num_running == 7
    coordinator.receive(encoder.encode(_stats(0, seq=1, epoch=2, running=0)))  # the restarted process
    assert coordinator.latest[0].num_running == 0


def test_a_restart_after_the_wall_clock_stepped_back_is_still_heard(coordinator, monkeypatch):
    """An engine's epoch is its start time: restarted after NTP set the clock back, its epoch is
    smaller. Once the old epoch has been silent for RESTART_SILENCE_S the new one counts; a
    smaller epoch while the old one still speaks (a late or forged message) does not."""
    clock = [1000.0]
    monkeypatch.setattr(coordinator_module.time, "monotonic", lambda: clock[0])
    coordinator.receive(encoder.encode(_stats(0, seq=9, epoch=2_000, running=7)))
    clock[0] += 1.0
    coordinator.receive(encoder.encode(_stats(0, seq=1, epoch=1_000, running=1)))  # the old epoch spoke 1 s ago
    assert coordinator.latest[0].num_running == 7
    clock[0] += 1.0  # the old epoch silent for 2 s: it has ended
    coordinator.receive(encoder.encode(_stats(0, seq=2, epoch=1_000, running=3)))
    assert coordinator.latest[0].num_running == 3
    clock[0] += 0.5
    coordinator.receive(encoder.encode(_stats(0, seq=10, epoch=2_000, running=9)))  # the dead one's late message
    for _ in range(4):  # the live engine reports every second and is back within RESTART_SILENCE_S of it
        clock[0] += 1.0
        coordinator.receive(encoder.encode(_stats(0, seq=3, epoch=1_000, running=3)))
    assert coordinator.latest[0].num_running == 3


def test_silent_ranks_are_listed_lost_until_they_report(coordinator, monkeypatch):
    now = time.monotonic()
    for rank in range(3):
        coordinator.receive(encoder.encode(_stats(rank, 1, 1)))
    assert coordinator.lost(now) == []
    later = now + coordinator_module.LOST_AFTER_S + 1
    coordinator.heard[0] = coordinator.heard[2] = later  # ranks 0 and 2 kept reporting; rank 1 went quiet
    assert coordinator.lost(later) == [1]
    coordinator.publish(later)
    assert coordinator.snapshot.lost_ranks == [1]


def test_a_running_wave_is_repeated_every_second_for_ranks_that_missed_it(coordinator, tmp_path):
    sub = coordinator.context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp_path}/waves")
    time.sleep(0.2)  # let the subscription reach the publisher
    coordinator.receive(encoder.encode(StartWave(4, rank=1)))
    assert to_engine_decoder.decode(sub.recv()) == StartWave(4, 1)
    coordinator.publish(time.monotonic())  # too soon: no repeat
    assert not sub.poll(100)
    coordinator.publish(time.monotonic() + 1.1)
    assert to_engine_decoder.decode(sub.recv()) == StartWave(4, -1)
    sub.close(linger=0)


def test_a_resize_adds_ranks_without_calling_them_lost_and_forgets_the_ranks_that_left(coordinator, monkeypatch):
    """``RankCount`` from the launcher (hybridlb.launch.scaling): a new rank has LOST_AFTER_S to
    report, like a rank at start; a rank that left is neither in the snapshot nor lost, and its
    late stats are dropped."""
    from hybridlb.protocol import RankCount

    clock = [1000.0]
    monkeypatch.setattr(coordinator_module.time, "monotonic", lambda: clock[0])
    for rank in range(3):
        coordinator.receive(encoder.encode(_stats(rank, 1, 1)))
    clock[0] += 60  # long after the start: a never-heard rank would be lost at once
    for rank in range(3):
        coordinator.receive(encoder.encode(_stats(rank, 2, 1)))
    coordinator.receive(encoder.encode(RankCount(4)))
    assert coordinator.size == 4 and coordinator.lost(clock[0]) == []
    assert coordinator.lost(clock[0] + coordinator_module.LOST_AFTER_S + 1) == [0, 1, 2, 3]
    coordinator.receive(encoder.encode(_stats(3, 1, 1, running=2)))
    coordinator.receive(encoder.encode(RankCount(2)))
    coordinator.receive(encoder.encode(_stats(3, 2, 1)))  # a late report of a rank that left
    coordinator.publish(clock[0])
    assert [stats.rank for stats in coordinator.snapshot.engines] == [0, 1] and coordinator.snapshot.lost_ranks == []
    coordinator.receive(encoder.encode(RankCount(0)))  # nonsense: dropped
    assert coordinator.size == 2
