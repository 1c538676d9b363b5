"""The multi-port supervisor's log at INFO holds what changed (a rank going down, coming
back), not its probes: one every few seconds per rank would be tens of thousands of lines a
day per pod (unit tier: fake rank servers, no engines)."""

from __future__ import annotations

import logging
import time

import pytest

from hybridlb.launch.supervisor import Supervisor
from tests.unit.dp.test_supervisor import FakeRanks

INTERVAL_S = 0.02


def _wait(predicate, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _mentions(records: list[logging.LogRecord], text: str, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= level and text in r.getMessage()]


@pytest.fixture
def ranks():
    fakes = FakeRanks(2)
    yield fakes
    for rank in fakes:
        fakes.kill(rank)


def test_probes_log_at_debug_and_state_changes_at_info(ranks, caplog):
    caplog.set_level(logging.DEBUG)
    node = Supervisor("127.0.0.1", 0, ranks, interval_s=INTERVAL_S, timeout_s=0.5, failure_threshold=2)
    node.start()
    try:
        assert node.wait_ready(10)
        probes = lambda: len(_mentions(caplog.records, f"{ranks[1]}/health", logging.DEBUG))  # noqa: E731
        _wait(lambda: probes() >= 20)  # rounds and rounds of probes, every one of them at DEBUG
        assert _mentions(caplog.records, "/health") == [], "a probe request reached the INFO log"
        assert _mentions(caplog.records, "rank 1") == [f"rank 1 ({ranks[1]}) is up"]

        ranks.kill(1)
        _wait(lambda: not node.children[1].healthy)
        seen = probes()
        _wait(lambda: probes() >= seen + 10)  # failed probes, also at DEBUG
        down = _mentions(caplog.records, "rank 1")[1:]
        assert len(down) == 1 and down[0].startswith(f"rank 1 ({ranks[1]}) is down: ")
        assert [r.levelno for r in caplog.records if r.getMessage() == down[0]] == [logging.WARNING]
        assert set(_mentions(caplog.records, "/health")) <= set(down)  # the failed probes stayed at DEBUG
    finally:
        node.stop()
