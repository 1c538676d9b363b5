"""Where an engine sits in the data-parallel cluster (from the launcher, at start-up)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DPContext:
    rank: int = 0
    size: int = 1
    coordinator_stats: str | None = None  # where to push load stats (None: no coordinator)
    coordinator_waves: str | None = None  # MoE lockstep: where StartWave comes from
    rendezvous: str | None = None  # MoE lockstep: torch.distributed init address
    token: str | None = None  # the cluster token: keys for TCP sockets (hybridlb.transport)
    address: str | None = None  # MoE lockstep: this node's address for the group (default: routes to the head)

    @property
    def lockstep(self) -> bool:
        """Whether this rank shares experts with the others and must step with them."""
        return self.rendezvous is not None and self.size > 1
