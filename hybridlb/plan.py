"""The rank map: config → nodes → global ranks → engines, API servers and ports.

A pure function, so every topology is checked in one place, before anything starts,
and ``hybridlb plan`` can print it. A config either describes the node it runs on (the
``--data-parallel-*`` flags: the other nodes arrive through the handshake) or lists every
node under ``data_parallel.nodes`` (then ranks must cover 0..size-1 exactly).

Ports on the head node (start rank 0): ``rpc_port`` handshake, ``+1`` coordinator stats
in (engines push), ``+2`` coordinator loads out (API servers subscribe), ``+3`` torch
distributed rendezvous and ``+4`` coordinator waves out (MoE with expert parallelism).
Engines that must be reachable from other nodes (internal
LB) listen on ``rpc_port + 16 + rank``; otherwise they use local IPC sockets.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from hybridlb.config import Config

ENGINE_PORT_OFFSET = 16


class PlanError(ValueError):
    """An impossible topology; ``problems`` lists each one with its fix."""

    def __init__(self, problems: list[str]):
        super().__init__("invalid data-parallel setup:\n" + "\n".join(f"  - {p}" for p in problems))
        self.problems = problems


@dataclass(frozen=True)
class ApiServerPlan:
    name: str  # process title suffix: "api:1" or "api:1.0"
    host: str
    port: int
    ranks: tuple[int, ...]  # the engines it balances over


@dataclass(frozen=True)
class NodePlan:
    index: int
    start_rank: int
    ranks: tuple[int, ...]
    headless: bool
    address: str | None  # where other nodes reach it; None: not named, learnt on the node at start
    api_servers: tuple[ApiServerPlan, ...]
    supervisor_port: int | None = None  # multi_port: where the node supervisor answers probes for every rank

    @property
    def is_head(self) -> bool:
        return self.start_rank == 0

    def http_port(self, rank: int) -> int | None:
        """The HTTP port requests for ``rank`` come in on here (None: no API server on this node serves it)."""
        return next((api.port for api in self.api_servers if rank in api.ranks), None)

    def summary(self) -> str:
        """One line: its index, ranks and API servers (``serve --dry-run``)."""
        servers = ", ".join(f"{a.name}@{a.host}:{a.port}→{list(a.ranks)}" for a in self.api_servers)
        supervisor = f", supervisor :{self.supervisor_port}" if self.supervisor_port else ""
        return f"{self.index}, ranks {list(self.ranks)}, " + ("headless" if self.headless
                                                              else f"API servers {servers}{supervisor}")


@dataclass(frozen=True)
class ClusterPlan:
    size: int
    mode: str
    head_address: str
    rpc_port: int
    nodes: tuple[NodePlan, ...]
    complete: bool  # every node is known (a full ``nodes`` list, or a single node)
    coordinator: bool  # whether a coordinator runs at all
    remote_engines: bool  # engines listen on TCP for API servers of other nodes
    lockstep: bool = False  # MoE experts sharded over the ranks: they step together in waves

    @property
    def multi_node(self) -> bool:
        return not self.complete or len(self.nodes) > 1

    @property
    def joins_cluster(self) -> bool:
        """Whether nodes must find each other through the head's rpc handshake (else each runs on its own)."""
        return self.multi_node and (self.coordinator or self.mode == "internal")

    def coordinator_stats_address(self) -> str:
        return f"tcp://{self.head_address}:{self.rpc_port + 1}"

    def coordinator_loads_address(self) -> str:
        return f"tcp://{self.head_address}:{self.rpc_port + 2}"

    def rendezvous_address(self) -> str:
        return f"tcp://{self.head_address}:{self.rpc_port + 3}"

    def coordinator_waves_address(self) -> str:
        return f"tcp://{self.head_address}:{self.rpc_port + 4}"

    def engine_port(self, rank: int) -> int:
        return self.rpc_port + ENGINE_PORT_OFFSET + rank

    def named_ports(self) -> frozenset[int]:
        """Every port this plan names (the rpc block, engines', API servers', supervisors')."""
        api = {p for node in self.nodes for p in (node.supervisor_port, *(a.port for a in node.api_servers)) if p}
        return frozenset(range(self.rpc_port, self.rpc_port + ENGINE_PORT_OFFSET + self.size)) | api


@dataclass(frozen=True)
class Listener:
    """A TCP port a node listens on: where, what for, and the option that moves it."""

    host: str
    port: int
    what: str
    option: str


def listeners(plan: ClusterPlan, node: NodePlan, head_block: bool = True) -> list[Listener]:
    """Every TCP port ``node`` listens on, each once: its API servers' (several may share one), its
    supervisor's, the head's rpc block (handshake, coordinator and waves when nodes join over TCP,
    the rendezvous of expert parallelism; ``head_block`` false: Ray draws those ports itself) and
    its engines' (internal LB over several nodes; only where the node's address is known, else it
    is learnt at start). One node alone keeps its coordinator on IPC sockets (``launch.node``)."""
    found = [Listener(api.host, api.port, f"API server {api.name}", "--port (api.port)")
             for api in node.api_servers]
    if node.supervisor_port is not None:
        found.append(Listener(node.api_servers[0].host, node.supervisor_port, f"the supervisor of node {node.index}",
                              "--data-parallel-supervisor-port (lb.supervisor_port)"))
    if node.is_head and head_block:
        block = {0: ("the rpc handshake", plan.joins_cluster),
                 1: ("the coordinator (stats in)", plan.coordinator and plan.multi_node),
                 2: ("the coordinator (loads out)", plan.coordinator and plan.multi_node),
                 3: ("the expert-parallel rendezvous", plan.lockstep),
                 4: ("the coordinator (waves out)", plan.lockstep and plan.multi_node)}
        found += [Listener(plan.head_address, plan.rpc_port + offset, what, "--data-parallel-rpc-port "
                           "(data_parallel.rpc_port)") for offset, (what, bound) in block.items() if bound]
    if plan.remote_engines and node.address is not None:
        found += [Listener(node.address, plan.engine_port(rank), f"engine {rank}", "--data-parallel-rpc-port "
                           "(data_parallel.rpc_port; engines take rpc_port + 16 + rank)") for rank in node.ranks]
    unique: dict[tuple[str, int], Listener] = {}
    for listener in found:
        unique.setdefault((listener.host, listener.port), listener)
    return list(unique.values())


def _api_server_count(config: Config, local_engines: int) -> int:
    wanted = config.lb.api_servers_per_node
    if wanted == "auto":
        return max(1, min(local_engines, (os.cpu_count() or 1) // 4))
    return wanted


def _node_specs(config: Config, problems: list[str]) -> list[tuple[int, int, bool, str | None, int | None]]:
    """(start_rank, size_local, headless, address, api_port) of every node this config knows."""
    dp = config.data_parallel
    if dp.nodes:
        specs, next_rank = [], 0
        for node in dp.nodes:
            start = node.start_rank if node.start_rank is not None else next_rank
            specs.append((start, node.size_local, node.headless, node.address, node.api_port))
            next_rank = start + node.size_local
        return specs
    if dp.rank is not None:
        if dp.size_local not in (None, 1):
            problems.append(f"data_parallel.rank={dp.rank} runs exactly one rank, but size_local={dp.size_local}; "
                            "drop --data-parallel-size-local")
        return [(dp.rank, 1, dp.headless, dp.node_address, None)]
    size_local = dp.size_local if dp.size_local is not None else dp.size
    return [(dp.start_rank, size_local, dp.headless, dp.node_address, None)]


def _mode(config: Config, problems: list[str]) -> str:
    dp, lb = config.data_parallel, config.lb
    if dp.rank is not None:
        if "mode" in lb.model_fields_set and lb.mode != "external":
            problems.append(f"data_parallel.rank is for external load balancing, but lb.mode={lb.mode}; "
                            "use --lb-mode external, or --data-parallel-start-rank for hybrid/internal")
        return "external"
    return lb.mode


def _label(specs, index: int) -> str:
    start = specs[index][0]
    return f"node {index} (start rank {start})" if len(specs) > 1 else f"this node (start rank {start})"


def _check_ranks(size: int, specs, complete: bool, problems: list[str]) -> None:
    owner: dict[int, int] = {}
    for index, (start, size_local, _, _, _) in enumerate(specs):
        where = _label(specs, index)
        if size_local > size:
            problems.append(f"{where}: size_local={size_local} is larger than data_parallel.size={size}; "
                            "lower size_local or raise size")
        elif start + size_local > size:
            problems.append(f"{where}: ranks {start}..{start + size_local - 1} go past data_parallel.size="
                            f"{size} (ranks are 0..{size - 1}); lower start_rank or size_local")
        for rank in range(start, start + size_local):
            if rank in owner and owner[rank] != index:
                problems.append(f"nodes {owner[rank]} and {index} both claim rank {rank}; "
                                "give each node its own start_rank")
            owner.setdefault(rank, index)
    missing = [r for r in range(size) if r not in owner]
    if complete and missing:
        problems.append(f"no node runs rank(s) {', '.join(map(str, missing))}; add a node with start_rank "
                        f"{missing[0]} or lower data_parallel.size")


def _check_mode(config: Config, mode: str, specs, problems: list[str]) -> None:
    explicit_api_servers = "api_servers_per_node" in config.lb.model_fields_set
    for index, (start, _, headless, _, _) in enumerate(specs):
        where = _label(specs, index)
        if headless and explicit_api_servers:
            problems.append(f"{where} is headless (engines only) but api_servers_per_node is set; "
                            "drop one of --headless / --api-servers-per-node")
        if mode == "hybrid" and headless:
            problems.append(f"{where}: hybrid mode runs an API server on every node, so it cannot be headless; "
                            "drop --headless, or use --lb-mode internal")
        if mode == "external" and headless:
            problems.append(f"{where}: external mode runs an API server per rank, so it cannot be headless; "
                            "drop --headless")
        if mode == "internal" and start == 0 and headless:
            problems.append(f"{where}: internal mode serves from the head node, which cannot be headless; "
                            "drop --headless there")
        if mode == "internal" and start != 0 and not headless:
            problems.append(f"{where}: internal mode runs API servers on the head only; "
                            "start this node with --headless")
    if mode in ("external", "multi_port") and explicit_api_servers and config.lb.api_servers_per_node != 1:
        problems.append(f"{mode} mode runs exactly one API server per rank; drop --api-servers-per-node")
    if mode == "multi_port":
        _check_multi_port(config, specs, problems)


def _check_autoscaling(config: Config, mode: str, nodes: int, lockstep: bool, problems: list[str]) -> None:
    """Autoscaling resizes one node (``hybridlb.launch.scaling``): what it cannot resize is refused at start."""
    scaling, size = config.autoscaling, config.data_parallel.size
    if scaling is None:
        return
    if nodes > 1 or lockstep or mode in ("multi_port", "external"):
        problems.append("autoscaling resizes a one-node cluster of a dense model (not several nodes, MoE "
                        "expert parallelism or multi-port / external LB nodes); remove the autoscaling section")
    if not scaling.min_replicas <= size <= scaling.max_replicas:
        problems.append(f"data_parallel.size={size} is outside autoscaling's {scaling.min_replicas}.."
                        f"{scaling.max_replicas}: start within the bounds")


def _check_multi_port(config: Config, specs, problems: list[str]) -> None:
    """vLLM's rules for --data-parallel-multi-port-external-lb, each with its fix."""
    size = config.data_parallel.size
    if size < 2:
        problems.append("multi-port mode needs --data-parallel-size of at least 2 (one rank needs no supervisor); "
                        "raise it, or drop --data-parallel-multi-port-external-lb")
    for index, (_, size_local, headless, _, api_port) in enumerate(specs):
        where = _label(specs, index)
        if headless:
            problems.append(f"{where}: multi-port mode serves every rank on its own port, so it cannot be headless; "
                            "drop --headless")
        if size_local < 2:
            problems.append(f"{where}: multi-port mode needs --data-parallel-size-local of at least 2 (one rank a "
                            "node is external LB: use --data-parallel-rank)")
        elif size % size_local:
            problems.append(f"{where}: --data-parallel-size {size} is not a multiple of --data-parallel-size-local "
                            f"{size_local}; give every node the same number of ranks")
        lb, port = config.lb, api_port if api_port is not None else config.api.port
        if port <= lb.supervisor_port < port + size_local:
            problems.append(f"{where}: --data-parallel-supervisor-port {lb.supervisor_port} overlaps the ranks' ports "
                            f"{port}-{port + size_local - 1}; pick a supervisor port outside them")


def _api_servers(config: Config, mode: str, index: int, start: int, ranks: tuple[int, ...], headless: bool,
                 host: str, port: int) -> tuple[ApiServerPlan, ...]:
    if headless:
        return ()
    if mode in ("external", "multi_port"):
        return tuple(ApiServerPlan(f"api:{index}.{i}", host, port + i, (rank,)) for i, rank in enumerate(ranks))
    served = ranks if mode == "hybrid" else tuple(range(config.data_parallel.size))
    count = _api_server_count(config, len(ranks))
    if count == 1:
        return (ApiServerPlan(f"api:{index}", host, port, served),)
    return tuple(ApiServerPlan(f"api:{index}.{i}", host, port, served) for i in range(count))


def _check_ports(plan: ClusterPlan, problems: list[str]) -> None:
    bound: dict[tuple[str, int], str] = {}

    def claim(address: str | None, port: int, what: str) -> None:
        if address is None:  # a node whose address is learnt at start is a host of its own
            return
        key = (address, port)
        if key in bound and bound[key] != what:
            problems.append(f"port {port} on {address} is used by both {bound[key]} and {what}; "
                            "change --port or --data-parallel-rpc-port")
        bound.setdefault(key, what)

    for node in plan.nodes:
        if node.is_head and (plan.multi_node or plan.coordinator):
            for offset, what in enumerate(("rpc handshake", "coordinator stats", "coordinator loads",
                                           "torch rendezvous", "coordinator waves")):
                claim(plan.head_address, plan.rpc_port + offset, what)
        if plan.remote_engines:
            for rank in node.ranks:
                claim(node.address, plan.engine_port(rank), f"engine {rank}")
        for api in node.api_servers:
            claim(node.address, api.port, f"API server {api.name.split('.')[0]}")
        if node.supervisor_port is not None:
            claim(node.address, node.supervisor_port, f"the supervisor of node {node.index}")


def _default_node_address(config: Config, start_rank: int, listed: bool) -> str | None:
    """A node's address when the config does not name it: the head's for the head. Another
    node of a ``nodes`` list is a host of its own (Ray places it, a LeaderWorkerSet schedules
    it); one described by the per-node flags runs beside the head on a one-machine (loopback)
    cluster. Otherwise None: the node learns it at start (the address routing to the head,
    ``netaddr.route_to``)."""
    dp = config.data_parallel
    if start_rank == 0:
        return dp.address
    if dp.node_address:
        return dp.node_address
    return dp.address if _is_loopback(dp.address) and not listed else None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def plan_cluster(config: Config, is_moe: bool | None = False) -> ClusterPlan:
    """Validate the topology and lay it out; raise PlanError listing every problem.

    ``is_moe`` comes from the checkpoint (None when it cannot be read here)."""
    problems: list[str] = []
    dp = config.data_parallel
    mode = _mode(config, problems)
    if config.engine.expert_parallel and is_moe is False:
        problems.append("expert parallelism needs a MoE checkpoint, and this model is dense; "
                        "drop --enable-expert-parallel")
    lockstep = bool(is_moe) and config.engine.expert_parallel and dp.size > 1
    specs = _node_specs(config, problems)
    complete = bool(dp.nodes) or (specs[0][1] == dp.size and specs[0][0] == 0)
    if dp.rank is not None and dp.rank >= dp.size:
        problems.append(f"data_parallel.rank={dp.rank} is out of range for size={dp.size} (ranks 0..{dp.size - 1}); "
                        "pick a rank below the size or raise --data-parallel-size")
    _check_ranks(dp.size, specs, complete, problems)
    _check_mode(config, mode, specs, problems)
    _check_autoscaling(config, mode, len(specs), lockstep, problems)
    nodes = []
    for index, (start, size_local, headless, address, api_port) in enumerate(specs):
        ranks = tuple(range(start, start + size_local))
        node_index = index if dp.nodes else start // max(1, size_local)
        host = address or _default_node_address(config, start, listed=bool(dp.nodes))
        port = api_port if api_port is not None else config.api.port
        servers = _api_servers(config, mode, node_index, start, ranks, headless, config.api.host, port)
        supervisor = config.lb.supervisor_port if mode == "multi_port" and not headless else None
        nodes.append(NodePlan(node_index, start, ranks, headless, host, servers, supervisor))
    plan = ClusterPlan(
        size=dp.size, mode=mode, head_address=dp.address, rpc_port=dp.rpc_port, nodes=tuple(nodes),
        complete=complete, coordinator=(dp.size > 1 or bool(config.autoscaling)) and (lockstep or mode != "external"),
        remote_engines=mode == "internal" and (not complete or len(nodes) > 1), lockstep=lockstep,
    )
    _check_ports(plan, problems)
    if problems:
        raise PlanError(problems)
    return plan


def format_plan(plan: ClusterPlan) -> str:
    """The plan as a table: one row per node, then the shared endpoints."""
    lines = [f"{'node':<6}{'ranks':<14}{'role':<22}{'API servers':<40}"]
    for node in plan.nodes:
        ranks = f"{node.ranks[0]}..{node.ranks[-1]}" if len(node.ranks) > 1 else str(node.ranks[0])
        role = ("head" if node.is_head else "worker") + (", headless" if node.headless else "")
        apis = ", ".join(f"{a.name}@{a.host}:{a.port}→{_ranks(a.ranks)}" for a in node.api_servers) or "-"
        if node.supervisor_port is not None:
            apis += f"; supervisor :{node.supervisor_port}"
        lines.append(f"{node.index:<6}{ranks:<14}{role:<22}{apis:<40}")
    lines.append(f"mode: {plan.mode}; data-parallel size {plan.size}"
                 + ("" if plan.complete else " (other nodes join through the rpc port)"))
    if plan.coordinator and not plan.multi_node:
        lines.append("coordinator: IPC sockets in the node's private runtime directory (stats in, loads out)")
    elif plan.coordinator:
        lines.append(f"coordinator: {plan.coordinator_stats_address()} (stats in), "
                     f"{plan.coordinator_loads_address()} (loads out)")
    else:
        lines.append("coordinator: none (" + ("one rank" if plan.size == 1 else "external LB, independent ranks") + ")")
    if plan.lockstep:
        lines.append(f"MoE expert parallel: experts sharded over {plan.size} ranks stepping in lockstep; "
                     f"waves {'IPC' if not plan.multi_node else plan.coordinator_waves_address()}, rendezvous "
                     f"{plan.rendezvous_address()}")
    if plan.multi_node:
        lines.append(f"rpc handshake: tcp://{plan.head_address}:{plan.rpc_port}")
    return "\n".join(lines)


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"[{ranks[0]}..{ranks[-1]}]" if len(ranks) > 2 else str(list(ranks))
