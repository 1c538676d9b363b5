"""An engine's compiled grammars: compiled once per distinct constraint, on a thread of their
own, never on the step path.

``matcher(constraint)`` returns a future. A constraint seen before (the cache keeps the
``size`` most recently used, and no more than ``max_bytes`` of them by the backend's own
measure, ``Backend.size_of``) resolves at once; a new one compiles on the grammar thread
while the request waits (the engine schedules it once the future is done), and concurrent
requests with the same constraint share that one compilation. ``cancel`` gives a waiting
request's future back (it was aborted): a compilation nobody waits for any more is dropped
from the queue before it starts. The backend itself (the library's view of the tokenizer,
built once) is made on the same thread, started when the engine starts, so the first
constrained request does not pay for it on the step path either.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

from hybridlb.grammar.backend import Backend, Matcher
from hybridlb.params import Constraint

log = logging.getLogger(__name__)
Key = tuple[str, str, bool, bool]


class GrammarCache:
    def __init__(self, make_backend: Callable[[], Backend], size: int, max_bytes: int = 0):
        """``max_bytes``: most bytes the compiled grammars may hold (0: count only)."""
        self.size, self.max_bytes = size, max_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._backend = self._pool.submit(make_backend)
        self._compiled: OrderedDict[Key, tuple[object, int]] = OrderedDict()  # key -> (compiled, bytes)
        self._compiling: dict[Key, Future] = {}
        self._waiters: dict[Key, set[Future]] = {}  # each request's future waiting for a compilation
        self._lock = threading.RLock()
        self.compiled = 0  # grammars compiled (cache misses)
        self.hits = 0
        self.cancelled = 0  # compilations dropped before they started: nobody waited any more
        self.compile_s = 0.0  # time spent compiling, in total
        self.held_bytes = 0

    def matcher(self, constraint: Constraint) -> Future[Matcher]:
        """A fresh matcher for ``constraint`` (the future raises GrammarError if it cannot compile)."""
        key = (constraint.kind, constraint.value, constraint.compact, constraint.closed)
        mine: Future[Matcher] = Future()
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None and self._backend.done():
                self._compiled.move_to_end(key)
                self.hits += 1
                self._set(mine, lambda: self._backend.result().matcher(cached[0]))
                return mine
            shared = self._compiling.get(key)
            if shared is None:
                shared = self._compiling[key] = self._pool.submit(self._compile, key, constraint)
            self._waiters.setdefault(key, set()).add(mine)
        shared.add_done_callback(lambda f: self._hand_out(key, f, mine))
        return mine

    def cancel(self, mine: Future) -> None:
        """A request waiting on ``mine`` is gone: stop waiting, and drop the compilation if it
        has not started and no other request waits for it."""
        mine.cancel()
        with self._lock:  # reentrant: cancelling the compilation runs its callbacks (_hand_out) here
            key = next((k for k, waiting in self._waiters.items() if mine in waiting), None)
            if key is None:
                return
            self._waiters[key].discard(mine)
            shared = self._compiling.get(key)
            if not self._waiters[key] and shared is not None and shared.cancel():
                self._compiling.pop(key, None)
                self._waiters.pop(key, None)
                self.cancelled += 1

    def _compile(self, key: Key, constraint: Constraint) -> object:
        backend = self._backend.result()
        started = time.perf_counter()
        try:
            compiled = backend.compile(constraint)
        finally:
            self.compile_s += time.perf_counter() - started
            with self._lock:
                self._compiling.pop(key, None)
        with self._lock:
            self.compiled += 1
            self._keep(key, compiled, backend.size_of(compiled))
        return compiled

    def _keep(self, key: Key, compiled: object, size: int) -> None:
        """Cache ``compiled``, evicting the least recently used past ``size`` entries or ``max_bytes``."""
        if self.max_bytes and size > self.max_bytes:
            return  # larger than the whole cache: used by its waiting requests, then dropped
        self._compiled[key] = (compiled, size)
        self.held_bytes += size
        while len(self._compiled) > self.size or (self.max_bytes and self.held_bytes > self.max_bytes):
            _, (_, dropped) = self._compiled.popitem(last=False)
            self.held_bytes -= dropped

    def _hand_out(self, key: Key, compiled: Future, mine: Future[Matcher]) -> None:
        with self._lock:
            self._waiters.get(key, set()).discard(mine)
            if not self._waiters.get(key, True):
                del self._waiters[key]
        if mine.done():  # cancelled: its request is gone
            return
        self._set(mine, lambda: self._backend.result().matcher(compiled.result()))

    @staticmethod
    def _set(future: Future, make: Callable[[], Matcher]) -> None:
        try:
            result = make()
        except Exception as exc:
            result = exc
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile: its request is gone
            future.set_exception(result) if isinstance(result, Exception) else future.set_result(result)

    @property
    def backend_name(self) -> str | None:
        return self._backend.result().name if self._backend.done() and not self._backend.exception() else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
