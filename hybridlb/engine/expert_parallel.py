"""Expert parallelism across the data-parallel ranks.

Experts are sharded: rank ``r`` of ``W`` holds experts ``[r*E/W, (r+1)*E/W)``. Every
MoE layer therefore needs every rank, every step:

1. all-gather each rank's hidden states (padded to the step's largest token count),
2. route every valid token (the router is replicated, so every rank agrees) and run the
   local experts on the tokens routed to them,
3. reduce-scatter the partial sums, so each rank gets back its own rows with every
   expert's contribution added.

Each step first all-gathers ``[tokens, has_work]`` of every rank (the step metadata):
the MoE layers need the token counts, and the engine needs to know whether any rank
has work. With ``async_metadata`` the exchange starts right after scheduling and is
awaited only by the first MoE layer, so it overlaps input preparation and the first
attention layer instead of stalling the step.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from hybridlb.netaddr import interface_of, route_to

log = logging.getLogger(__name__)


def init_group(rendezvous: str, rank: int, size: int, device: torch.device, timeout_s: float,
               address: str | None = None):
    """Join the torch.distributed group of all ranks: gloo on CPU, nccl (plus a gloo
    group for the small CPU metadata) on CUDA. Returns (group for tensors, group for metadata).

    The group's connections use ``address`` (default: this host's address that routes to the
    rendezvous host), never what the hostname resolves to (see ``_use_interface``)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    url = urlparse(rendezvous)
    _use_interface(address or route_to(url.hostname, url.port))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _store(rendezvous, rank, size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    meta = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    return dist.group.WORLD, meta


def _use_interface(address: str) -> None:
    """Make gloo (and nccl's bootstrap) connect from the interface holding ``address``. Left to
    itself gloo takes the address the hostname resolves to, and where that is loopback (Debian's
    127.0.1.1) it tells its peers to dial 127.0.0.1. A GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    the user set wins."""
    interface = interface_of(address)
    if interface is None:
        raise RuntimeError(f"the expert-parallel group should use {address}, but no network interface of this "
                           "host has that address; set --data-parallel-node-address to one of this host's "
                           "addresses that the other nodes reach")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    log.info("expert-parallel group: this rank connects from %s (%s)", address, interface)


def _store(rendezvous: str, rank: int, size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's key-value store, served by rank 0 at ``rendezvous`` (``tcp://host:port``).

    torch's store server listens on every interface; rank 0 hands it a socket bound to
    the rendezvous host instead, so the store is only reachable where it was configured."""
    url = urlparse(rendezvous)
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in url.hostname else socket.AF_INET
        listen_fd = socket.create_server((url.hostname, url.port), family=family).detach()
    return dist.TCPStore(url.hostname, url.port, size, is_master=rank == 0, timeout=timeout,
                         master_listen_fd=listen_fd)


def expert_range(num_experts: int, rank: int, size: int) -> range:
    if num_experts % size:
        raise ValueError(f"the model has {num_experts} experts, which {size} data-parallel ranks cannot share "
                         "evenly; use a data-parallel size that divides it or drop --enable-expert-parallel")
    per_rank = num_experts // size
    return range(rank * per_rank, (rank + 1) * per_rank)


class ExpertParallel:
    def __init__(self, rank: int, size: int, device: torch.device, group, meta_group, async_metadata: bool):
        self.rank, self.size, self.device = rank, size, device
        self.group, self.meta_group = group, meta_group
        self.async_metadata = async_metadata
        self._meta = torch.zeros(size, 2, dtype=torch.long)
        self._handle = None
        self._counts: list[int] | None = None
        self.collective_s = 0.0  # time in the MoE layers' all-gather / reduce-scatter
        self.meta_s = 0.0  # time blocked on the step metadata (what async overlap hides)

    # -- step metadata -------------------------------------------------------------------
    def begin_step(self, num_tokens: int, has_work: bool) -> None:
        """Start exchanging this rank's [tokens, has_work] with every rank."""
        mine = torch.tensor([num_tokens, int(has_work)], dtype=torch.long)
        self._counts = None
        started = time.perf_counter()
        self._handle = dist.all_gather_single(self._meta.view(-1), mine, group=self.meta_group,
                                              async_op=self.async_metadata)
        self.meta_s += time.perf_counter() - started
        if not self.async_metadata:
            self._finish()

    def _finish(self) -> None:
        if self._counts is not None:
            return
        started = time.perf_counter()
        if self._handle is not None:
            self._handle.wait()
        self.meta_s += time.perf_counter() - started
        self._counts = self._meta[:, 0].tolist()
        self._any_work = bool(self._meta[:, 1].any())

    @property
    def counts(self) -> list[int]:
        """Tokens of every rank this step (waits for the metadata if still in flight)."""
        self._finish()
        return self._counts

    @property
    def any_work(self) -> bool:
        self._finish()
        return self._any_work

    # -- the MoE layer -------------------------------------------------------------------
    def dispatch_combine(self, block, x: torch.Tensor) -> torch.Tensor:
        """Run ``block`` (a MoEBlock holding this rank's experts) on every rank's tokens."""
        counts = self.counts
        width = max(counts)
        padded = x.new_zeros(width, x.shape[1])
        padded[: x.shape[0]] = x
        gathered = x.new_empty(self.size * width, x.shape[1])
        started = time.perf_counter()
        dist.all_gather_single(gathered, padded, group=self.group)
        self.collective_s += time.perf_counter() - started
        valid = torch.cat([torch.arange(r * width, r * width + n, device=x.device) for r, n in enumerate(counts)])
        tokens = gathered.index_select(0, valid)
        partial = torch.zeros_like(gathered)
        partial.index_copy_(0, valid, block.run_experts(tokens, *block.route(tokens)))
        out = x.new_empty(width, x.shape[1])
        started = time.perf_counter()
        dist.reduce_scatter_single(out, partial, group=self.group)
        self.collective_s += time.perf_counter() - started
        return out[: x.shape[0]]
