"""The node launcher's word on a dead engine: how it ended (a signal by its name), and the
process reaped at once, not left ``<defunct>`` until the node stops (unit tier: one child
process, no model).

A process's sentinel closes when its files do, a moment before the kernel makes it a zombie
whose status can be collected; the child here stretches that moment (it closes its files,
then lives on for a while before it is killed), so the race is the same every run."""

from __future__ import annotations

import signal

from hybridlb import lifecycle


def test_exit_texts():
    assert lifecycle.exit_text(0) == "exited with code 0"
    assert lifecycle.exit_text(3) == "exited with code 3"
    assert lifecycle.exit_text(-signal.SIGTERM) == "was killed by SIGTERM"
    assert lifecycle.exit_text(None) == "is gone (its exit status is not known yet)"
