"""Process trees as /proc shows them: descendants, resident memory, CPU time, quiet."""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants."""
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.append(current)
    return found


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants."""
    return _tree_kib(pid, "status", "VmRSS:") / 1024


def tree_pss_mib(pid: int) -> float:
    """Proportional memory of a process and its descendants: each shared page split among the
    processes mapping it, so pages forked processes share count once (their RSS counts them in each)."""
    return _tree_kib(pid, "smaps_rollup", "Pss:") / 1024


def _tree_kib(pid: int, table: str, field: str) -> int:
    """The sum of ``field`` (in kB) of /proc/PID/``table`` over a process and its descendants."""
    total = 0
    for current in process_tree(pid):
        try:
            text = Path(f"/proc/{current}/{table}").read_text()
            total += int(next(line.split()[1] for line in text.splitlines() if line.startswith(field)))
        except (FileNotFoundError, StopIteration, ProcessLookupError, PermissionError):
            continue
    return total


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time of ``pids`` (not their children)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_quiet(pids: list[int], below: float = 0.05, timeout_s: float = 20.0) -> float:
    """Wait until the process trees of ``pids`` use under ``below`` of a core for half a second:
    a server that just finished a run may still be freeing and logging, and would take CPU from
    the next run of the other server. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        trees = [p for pid in pids for p in process_tree(pid)]
        before = cpu_seconds(trees)
        time.sleep(0.5)
        if (cpu_seconds(trees) - before) / 0.5 < below:
            break
    return time.monotonic() - started


def child_titles(pid: int) -> dict[str, int]:
    """Command line (a process title for hybridlb's own) → pid of ``pid``'s descendants (an engine is
    its node's fork server's child)."""
    titles = {}
    for child in process_tree(pid)[1:]:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except FileNotFoundError:
            continue
        titles[cmdline] = int(child)
    return titles
