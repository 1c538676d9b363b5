"""What became of the requests an engine's failure took off it: each one, once, moved on to
another engine or lost, and one log line for them all.

``EngineConnection.fail_all`` hands every request it had in flight the same
``EngineUnavailable``, carrying one ``Evacuation``; the ``RequestRunner`` of each request says
how it ended (``settle``): ``moved`` (it went on on another engine, or on the same one once it
answered again), ``lost`` (its client got the error) or ``abandoned`` (its client had gone
already). Only ``lost`` ones count in ``hybridlb:lost_requests_total``; the runner counts the
``moved`` ones in ``hybridlb:migrated_requests_total``. When the last one has said, the tally
goes to the log ("4 moved, 0 lost"), after the connection's line saying the engine went down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("hybridlb.api.dispatch.engine_client")  # beside the connection's own lines
OUTCOMES = ("moved", "lost", "abandoned")


@dataclass
class Evacuation:
    """The requests one failure took off engine ``rank``, and how many of them ended how."""

    rank: int
    reason: str  # the EngineUnavailable reason: engine_down, stuck, lost_output, reader_error, shutdown
    count: int
    on_lost: Callable[[int, str, int], None] | None = None  # (rank, reason, count), for metrics
    report: bool = True  # log the tally (not at shutdown, where nothing moves and the first line said so)
    ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))

    @property
    def unsettled(self) -> int:
        return self.count - sum(self.ended.values())

    def settle(self, outcome: str, request_id: str) -> None:
        """Request ``request_id`` ended ``outcome`` (one of OUTCOMES); the last to settle logs the tally."""
        if self.unsettled <= 0:  # each request settles once; a stray second word changes nothing
            return
        self.ended[outcome] += 1
        log.debug("engine %d: request %s %s", self.rank, request_id, outcome)
        if outcome == "lost" and self.on_lost is not None:
            self.on_lost(self.rank, self.reason, 1)
        if self.unsettled == 0 and self.report:
            log.log(logging.ERROR if self.ended["lost"] else logging.WARNING, "%s", self.summary())

    def summary(self) -> str:
        moved, lost, gone = (self.ended[outcome] for outcome in OUTCOMES)
        text = f"engine {self.rank}: of its {self.count} in-flight requests, {moved} moved, {lost} lost"
        return text + (f", {gone} whose client had gone" if gone else "")
