"""An engine's compiled grammars: compiled once per distinct constraint, on a thread of their
own, never on the step path.

``matcher(constraint)`` returns a future. A constraint seen before (the cache keeps the
``size`` most recently used) resolves at once; a new one compiles on the grammar thread
while the request waits (the engine schedules it once the future is done), and concurrent
requests with the same constraint share that one compilation. The backend itself (the
library's view of the tokenizer, built once) is made on the same thread, started when the
engine starts, so the first constrained request does not pay for it on the step path either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from hybridlb.grammar.backend import Backend, Matcher
from hybridlb.params import Constraint

log = logging.getLogger(__name__)


class GrammarCache:
    def __init__(self, make_backend: Callable[[], Backend], size: int):
        self.size = size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._backend = self._pool.submit(make_backend)
        self._compiled: OrderedDict[tuple[str, str, bool, bool], object] = OrderedDict()
        self._compiling: dict[tuple[str, str, bool, bool], Future] = {}
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses)
        self.hits = 0
        self.compile_s = 0.0  # time spent compiling, in total

    def matcher(self, constraint: Constraint) -> Future[Matcher]:
        """A fresh matcher for ``constraint`` (the future raises GrammarError if it cannot compile)."""
        key = (constraint.kind, constraint.value, constraint.compact, constraint.closed)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None and self._backend.done():
                self._compiled.move_to_end(key)
                self.hits += 1
                done: Future[Matcher] = Future()
                try:
                    done.set_result(self._backend.result().matcher(compiled))
                except Exception as exc:
                    done.set_exception(exc)
                return done
            shared = self._compiling.get(key)
            if shared is None:
                shared = self._compiling[key] = self._pool.submit(self._compile, key, constraint)
        mine: Future[Matcher] = Future()
        shared.add_done_callback(lambda f: self._hand_out(f, mine))
        return mine

    def _compile(self, key: tuple[str, str, bool, bool], constraint: Constraint) -> object:
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
            self._compiled[key] = compiled
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        return compiled

    def _hand_out(self, compiled: Future, mine: Future[Matcher]) -> None:
        if (error := compiled.exception()) is not None:
            mine.set_exception(error)
            return
        try:
            mine.set_result(self._backend.result().matcher(compiled.result()))
        except Exception as exc:
            mine.set_exception(exc)

    @property
    def backend_name(self) -> str | None:
        return self._backend.result().name if self._backend.done() and not self._backend.exception() else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
