"""The node launcher's word on a dead engine: how it ended (a signal by its name), and the
process reaped at once, not left ``<defunct>`` until the node stops (unit tier: one child
process, no model).

A process's sentinel closes when its files do, a moment before the kernel makes it a zombie
whose status can be collected; the child here stretches that moment (it closes its files,
then lives on for a while before it is killed), so the race is the same every run."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import wait
from pathlib import Path
from types import SimpleNamespace

from hybridlb.launch.node import Node

LINGER_S = 0.5


def _close_files_then_die() -> None:
    os.closerange(3, 1 << 16)  # the sentinel's end among them: the launcher sees it end now
    time.sleep(LINGER_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _dying_engine(rank: int) -> SimpleNamespace:
    process = multiprocessing.get_context("spawn").Process(target=_close_files_then_die, daemon=True)
    process.start()
    assert wait([process.sentinel], timeout=30), "the child never closed its files"
    return SimpleNamespace(rank=rank, process=process)


def _node(engines: list) -> Node:
    """A launcher with only what watching its engines needs (no plan, no processes of its own)."""
    node = Node.__new__(Node)
    node.engines, node.restarts, node.stopping, node.supervisor = engines, {}, False, None
    node.plan = SimpleNamespace(lockstep=False, mode="hybrid")
    node.config = SimpleNamespace(data_parallel=SimpleNamespace(restart_policy="none"))
    return node


def test_a_killed_engine_is_named_by_its_signal_and_reaped_at_once(caplog):
    engine = _dying_engine(0)
    caplog.set_level(logging.ERROR, logger="hybridlb.serve")
    assert _node([engine])._engine_died(engine) is True  # a dense node serves on
    assert [r.getMessage() for r in caplog.records] == ["engine 0 was killed by SIGKILL"]
    assert _state(engine.process.pid) is None, "the dead engine is left a zombie"
