"""Process lifecycle helpers every hybridlb process uses: title, parent death, SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import resource
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

import setproctitle

_PR_SET_PDEATHSIG = 1
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

log = logging.getLogger(__name__)


def set_title(title: str) -> None:
    """Name this process (``hybridlb:engine:3``) so ps and top show the topology."""
    setproctitle.setproctitle(title)


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so nothing is orphaned."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def leave_interrupts_to_the_launcher() -> None:
    """In a child process of a launcher: ignore SIGINT until the child sets its own handlers. A
    terminal's Ctrl-C reaches the whole process group; the launcher then stops its children in
    order (SIGTERM), so a child still loading must not die of it mid-import with a traceback.
    The child starts with SIGINT blocked (``spawning``), so none arrives before this runs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def spawning():
    """Start child processes with SIGINT blocked (a mask they inherit, until
    ``leave_interrupts_to_the_launcher``); in this process a SIGINT meanwhile waits until the end."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def on_terminate(callback: Callable[[], None]) -> None:
    """Run ``callback`` on SIGTERM (it must only set flags and wake loops). SIGINT stays
    ignored: a terminal's Ctrl-C reaches the whole group, and the launcher stops its children
    in order (an engine serves on while the API servers let requests finish)."""
    signal.signal(signal.SIGTERM, lambda *_: callback())
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived while a launcher was starting: stop what started and exit. A
    BaseException, as KeyboardInterrupt is, so no `except Exception` on the way swallows it."""


class StopSignals:
    """SIGINT and SIGTERM for a launcher (``serve``, ``up``), at any moment of its life.

    The first signal asks for an orderly stop: it prints one line saying what is being
    stopped, sets ``requested`` and, while ``starting`` is true, raises ``Interrupted`` in the
    main thread, so whatever start-up is waiting on gives up at once (with ``interrupt=False``
    it only sets ``requested``: for waits inside libraries that cannot take an exception from a
    signal handler, which poll ``requested`` instead). A second signal forces it: ``force()``
    (kill what started, without waiting) runs, and the process exits 130.
    """

    def __init__(self, what: str, force: Callable[[], None], on_stop: Callable[[], None] | None = None,
                 interrupt: bool = True):
        """``on_stop`` runs on the first signal (it must only set flags and wake loops)."""
        self.what, self.force, self.on_stop, self.interrupt = what, force, on_stop, interrupt
        self.requested = False
        self.starting = True
        self.install()

    def install(self) -> None:
        """(Again) take SIGINT and SIGTERM: a library may have set its own (``ray.init`` sets SIGTERM's)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            print(f"{name} again: killing {self.what} now", file=sys.stderr, flush=True)
            try:
                self.force()
            finally:
                os._exit(130)
        self.requested = True
        print(f"{name}: stopping {self.what} (again to kill it now)", file=sys.stderr, flush=True)
        if self.on_stop is not None:
            self.on_stop()
        if self.starting and self.interrupt:
            raise Interrupted(f"{name} while starting")

    def check(self) -> None:
        """Raise ``Interrupted`` if a stop was asked for (the polling side of ``interrupt=False``)."""
        if self.requested:
            raise Interrupted("stopped while starting")


def raise_open_files_limit(target: int = 65536) -> int:
    """Lift the soft open-files limit towards ``target`` (never above the hard limit); return it.

    Every client connection is a file descriptor, and the usual soft default of 1024 makes
    a burst of ~1,000 connections fail (accept() hits EMFILE, and clients see their
    connections closed). The hard limit is the administrator's ceiling; the soft one is
    ours to raise.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        target = min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def tune_allocator() -> None:
    """Keep freed memory in the heap instead of returning it to the OS.

    A forward pass allocates large temporaries (gathered KV context, MLP activations).
    By default glibc serves big ones with fresh mmaps and trims freed heap memory, so
    every step pays page faults on the same sizes again; this measured 15-20% of
    mixed-workload throughput on CPU.
    """
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS once (after loading, whose temporaries
    ``tune_allocator`` would otherwise keep resident for the process's life)."""
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_mib() -> float:
    """This process's resident set size in MiB (0 where /proc is not there to say)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def configure_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get("HYBRIDLB_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s [{name}] %(message)s",
        datefmt="%H:%M:%S",
    )


# A Unix socket's path fits in 107 bytes; under the directory go "hybridlb-xxxxxxxx/" and the
# longest socket name ("coordinator-stats", "engine-1023"), with room to spare.
SUN_PATH_BYTES = 107
MAX_SOCKET_DIR = SUN_PATH_BYTES - 48


def socket_tmpdir() -> str:
    """Where runtime directories holding IPC sockets go: TMPDIR, unless it is too long for the
    sockets' paths to fit in sun_path; then /tmp."""
    base = tempfile.gettempdir()
    if len(base) <= MAX_SOCKET_DIR:
        return base
    log.info("TMPDIR %s is too long for the IPC sockets' paths (%d bytes at most); they go under /tmp",
             base, SUN_PATH_BYTES)
    return "/tmp"


def private_dir(path: str | None = None) -> str:
    """A directory only this user can enter (0700), for IPC sockets and metrics files: a new
    temporary one, or ``path``, made if missing and refused if another user could enter it
    (anyone who can connect to an engine's socket can send it requests)."""
    if path is None:
        return tempfile.mkdtemp(prefix="hybridlb-", dir=socket_tmpdir())  # mkdtemp makes it 0700
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} must be a directory of this user (it holds the engines' sockets), but it "
                              "is not; remove it and start again")
    if info.st_mode & 0o077:  # ours, left by an older version or another umask: close it
        os.chmod(path, 0o700)
    return path


def descendants(pid: int | None = None) -> list[int]:
    """Every process below ``pid`` (default: this one), from /proc (Linux)."""
    found, todo = [], [pid or os.getpid()]
    while todo:
        current = todo.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                children = [int(child) for child in (task / "children").read_text().split()]
                found += children
                todo += children
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def reap(process: BaseProcess, timeout_s: float = 2.0) -> str:
    """Collect the exit status of a child ``multiprocessing.Process`` seen to end (its sentinel)
    and say how it ended. Its sentinel closes a moment before the kernel makes it a zombie, so
    ``exitcode`` may still read None: poll until it does not, which also reaps it (no
    ``<defunct>`` left until shutdown)."""
    deadline = time.monotonic() + timeout_s
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return exit_text(process.exitcode)


def exit_text(code: int | None) -> str:
    """How a process ended, from its ``exitcode``: "exited with code 1", "was killed by SIGKILL"."""
    if code is None:
        return "is gone (its exit status is not known yet)"
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); return those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [pid for pid in pids if _running(pid)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return "Z (zombie)" not in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


async def supervised(name: str, start, retry_s: float = 1.0) -> None:
    """Run ``await start()`` for as long as the calling task lives: a background loop that
    raises is logged with its traceback and started again after ``retry_s``, never left dead
    with nobody noticing. Cancelling the task ends it."""
    while True:
        try:
            await start()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; starting it again in %g s", name, retry_s)
            await asyncio.sleep(retry_s)
