"""Free ports for the servers a test or a benchmark starts."""

from __future__ import annotations

import random
import socket

from hybridlb.netaddr import quiet_port_band

_handed_out: set[int] = set()
# Defaults a server takes without being told: torch.distributed's 29500 and vLLM's (and hybridlb's)
# data-parallel RPC port 29550. A server given a drawn API port and the default RPC port would clash.
_DEFAULTS = set(range(29500, 29600))


def free_port() -> int:
    """A free port for a server: one of ``free_port_range``'s blocks of one."""
    return free_port_range(1)


def free_port_range(count: int) -> int:
    """A base port with ``count`` consecutive free ports after it (a coordinator's block, a server's port).

    Drawn below the kernel's ephemeral range (Linux: 32768-60999, where every outgoing connection and
    every bind to port 0 get their ports) and above Ray's worker ports (10002-19999): a port handed
    out cannot be taken by a connection some process (a Ray worker, another server) opens before
    the server binds it, and is never handed out twice in one run."""
    band = quiet_port_band()
    low, high = band.start, band.stop
    for _ in range(200):
        base = random.randrange(low, high - count)
        block = set(range(base, base + count))
        if not block & (_handed_out | _DEFAULTS) and all(port_is_free(port) for port in block):
            _handed_out.update(block)  # not handed out twice in one run, bound or not yet
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {low}..{high}")


def port_is_free(port: int) -> bool:
    """Whether nothing listens on (or holds) 127.0.0.1:port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
