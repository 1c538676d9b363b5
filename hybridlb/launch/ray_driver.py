"""``hybridlb up / status / down``: the cluster placed on Ray by one driver.

``up`` lays the cluster out (``hybridlb.plan``), checks it fits the Ray cluster before
starting anything, reserves one placement-group bundle per node (STRICT_SPREAD, each
sized for that node's API servers and engines, optionally pinned by a node's custom
resource or IP), then starts the coordinator on the head's bundle, the engines, and,
once every engine answered (the barrier), the API servers. Everything is named
``hybridlb:<name>:<role>[:<rank or node>]`` in the ``hybridlb`` namespace. Without
``--detach`` the driver waits and tears it all down on Ctrl-C / SIGTERM; with it the
actors outlive the driver, and ``status`` / ``down`` find them by name.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridlb import lifecycle
from hybridlb.api.context import ApiServerSpec
from hybridlb.checkpoint.spec import CheckpointError, load_spec
from hybridlb.config import Config
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.spawn import node_core_share
from hybridlb.launch.ray_actors import (
    ApiServerActor,
    CoordinatorActor,
    EngineActor,
    free_ports,
    remove_runtime_dir,
)
from hybridlb.plan import ClusterPlan, NodePlan
from hybridlb.transport import cluster_token

log = logging.getLogger("hybridlb.up")


class UpError(RuntimeError):
    """The cluster cannot be placed or started; the message says why and what to change."""


def actor_name(cluster: str, role: str, index: int | str | None = None) -> str:
    return f"hybridlb:{cluster}:{role}" + ("" if index is None else f":{index}")


def connect(address: str | None, namespace: str, num_cpus: float | None = None) -> None:
    """Join the Ray cluster at ``address``, or start a private local one with at least
    ``num_cpus`` logical CPUs (Ray's unit of placement, not a thread count: engines set
    their torch threads themselves), so the config fits however many cores this machine has."""
    if ray.is_initialized():
        return
    local = {}
    if not address:
        local = {"num_cpus": max(os.cpu_count() or 1, math.ceil(num_cpus or 0)), "include_dashboard": True}
    ray.init(address=address or "local", namespace=namespace, log_to_driver=False, **local)


class Placement:
    """One bundle per node: its size, and how to schedule an actor into it."""

    def __init__(self, config: Config, plan: ClusterPlan):
        self.config, self.plan = config, plan
        gpus = config.ray.gpus_per_engine
        self.gpus = gpus if gpus is not None else (1.0 if config.engine.device == "cuda" else 0.0)
        self.bundles = [self._bundle(node) for node in plan.nodes]
        self.group = None

    def _bundle(self, node: NodePlan) -> dict[str, float]:
        ray_cfg = self.config.ray
        cpus = len(node.ranks) * ray_cfg.cpus_per_engine + len(node.api_servers) * ray_cfg.cpus_per_api_server
        bundle = {"CPU": cpus}
        if self.gpus:
            bundle["GPU"] = len(node.ranks) * self.gpus
        spec = (self.config.data_parallel.nodes or [None] * len(self.plan.nodes))[node.index]
        if spec is not None and spec.ray_resource:
            bundle[spec.ray_resource] = 0.001
        elif spec is not None and spec.address:
            bundle[f"node:{spec.address}"] = 0.001
        return bundle

    def check_fits(self) -> None:
        """Fail before starting anything if the Ray cluster cannot hold the bundles."""
        nodes = [n for n in ray.nodes() if n["Alive"]]
        if len(self.bundles) > 1 and len(nodes) < len(self.bundles):
            raise UpError(f"the config has {len(self.bundles)} nodes but the Ray cluster has {len(nodes)}; "
                          "add Ray nodes or list fewer nodes in data_parallel.nodes")
        for index, bundle in enumerate(self.bundles):
            if not any(all(n["Resources"].get(k, 0) >= v for k, v in bundle.items()) for n in nodes):
                largest = max((n["Resources"].get("CPU", 0) for n in nodes), default=0)
                raise UpError(f"node {index} needs {bundle} but no Ray node has that much (largest: {largest} CPUs); "
                              "lower data_parallel ranks per node, ray.cpus_per_engine, or add resources")

    def reserve(self, name: str, detached: bool, timeout_s: float) -> None:
        strategy = "STRICT_SPREAD" if len(self.bundles) > 1 else "PACK"
        self.group = placement_group(self.bundles, strategy=strategy, name=name,
                                     lifetime="detached" if detached else None)
        if not self.group.wait(timeout_seconds=timeout_s):
            raise UpError(f"Ray could not place {len(self.bundles)} bundles {self.bundles} within {timeout_s:.0f} s; "
                          "other clusters or tasks may hold the resources (see `hybridlb status` / `ray status`)")

    def on(self, node: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=node)


class RayCluster:
    """The actors of one ``up``, started in order and stopped together."""

    def __init__(self, config: Config, plan: ClusterPlan, detached: bool, private: bool = False):
        """``private``: on the one-machine Ray cluster ``up`` started itself, so every socket
        binds loopback (as ``serve``'s defaults do)."""
        self.config, self.plan, self.detached = config, plan, detached
        self.host = "127.0.0.1" if private else None
        self.name = config.ray.name
        self.placement = Placement(config, plan)
        self.coordinator = None
        self.engines: dict[int, object] = {}
        self.apis: list[tuple[NodePlan, object]] = []
        # restart_policy restart: Ray restarts any actor that dies (a MoE group: see Engine).
        self.restarts = -1 if config.data_parallel.restart_policy == "restart" else 0
        self.token = cluster_token(config.data_parallel.cluster_token)  # actors may not share our environment

    def _options(self, role: str, index=None, node: int = 0, **resources) -> dict:
        return dict(name=actor_name(self.name, role, index), namespace=self.config.ray.namespace,
                    lifetime="detached" if self.detached else None, scheduling_strategy=self.placement.on(node),
                    **resources)

    def start(self) -> None:
        timeout = self.config.ray.ready_timeout_s
        self.placement.check_fits()
        self.placement.reserve(actor_name(self.name, "pg"), self.detached, timeout)
        shared = self._start_coordinator()
        self._start_engines(shared)
        addresses = dict(zip(self.engines, ray.get([e.address.remote() for e in self.engines.values()],
                                                   timeout=timeout), strict=True))
        self._start_api_servers(addresses, shared.get("loads"))
        ready = ray.get([api.wait_ready.remote(timeout) for _, api in self.apis], timeout=timeout + 10)
        if not all(ready):
            raise UpError("an API server never saw all of its engines ready")

    def _start_coordinator(self) -> dict:
        if not self.plan.coordinator:
            return {}
        ip, ports = ray.get(free_ports.options(scheduling_strategy=self.placement.on(0)).remote(4, self.host),
                            timeout=60)
        if self.host is None and not self.token:
            log.warning("no cluster token: the coordinator listens on %s, beyond loopback, and any host that "
                        "reaches it can inject load stats; set data_parallel.cluster_token", ip)
        options = self._options("coordinator", num_cpus=0, max_restarts=self.restarts)
        self.coordinator = CoordinatorActor.options(**options).remote(self.name, self.plan.size, self.plan.lockstep,
                                                                 ip, ports, self.token)
        return ray.get(self.coordinator.addresses.remote(), timeout=60)

    def _start_engines(self, shared: dict) -> None:
        cfg = self.config
        threads = cfg.engine.torch_threads or max(1, int(cfg.ray.cpus_per_engine))
        for node in self.plan.nodes:
            # The node's engines share the CPUs Ray reserved for them (table path: see Engine).
            cores = node_core_share(cfg.engine, "", f"cores-node{node.index}", len(node.ranks),
                                    threads * len(node.ranks))
            for rank, share in zip(node.ranks, cores, strict=True):
                dp = DPContext(rank, self.plan.size, shared.get("stats"), shared.get("waves"), shared.get("rendezvous"),
                               self.token)
                options = self._options("engine", rank, node.index, num_cpus=cfg.ray.cpus_per_engine,
                                        num_gpus=self.placement.gpus, max_restarts=self.restarts)
                port = self.plan.engine_port(rank) if self.plan.remote_engines else None
                self.engines[rank] = EngineActor.options(**options).remote(self.name, cfg.engine, dp, node.index, port,
                                                                      threads, self.host, share)

    def _start_api_servers(self, addresses: dict[int, str], loads: str | None) -> None:
        for node in self.plan.nodes:
            ports = [a.port for a in node.api_servers]
            for api in node.api_servers:
                spec = ApiServerSpec(tuple((r, addresses[r]) for r in api.ranks), api.name, node.index,
                                     self.plan.mode, loads, self.config.lb.policy, self.token)
                options = self._options("api", api.name.split(":", 1)[1], node.index,
                                        num_cpus=self.config.ray.cpus_per_api_server, max_restarts=self.restarts)
                actor = ApiServerActor.options(**options).remote(self.name, self.config, spec, api.host, api.port,
                                                            ports.count(api.port) > 1)
                self.apis.append((node, actor))

    def table(self) -> str:
        urls = ray.get([api.url.remote() for _, api in self.apis])
        node_ids = ray.get([api.node_id.remote() for _, api in self.apis])
        lines = [f"{'node':<6}{'ranks':<12}{'Ray node':<16}{'URL':<30}"]
        for (node, _), url, node_id in zip(self.apis, urls, node_ids, strict=True):
            ranks = f"{node.ranks[0]}..{node.ranks[-1]}" if len(node.ranks) > 1 else str(node.ranks[0])
            lines.append(f"{node.index:<6}{ranks:<12}{node_id[:12]:<16}{url}/v1")
        for node in self.plan.nodes:
            if node.headless:
                lines.append(f"{node.index:<6}{node.ranks[0]}..{node.ranks[-1]:<9}{'':<16}(headless)")
        return "\n".join(lines)

    def stop(self) -> None:
        down(self.name, namespace=self.config.ray.namespace, quiet=True)


def up(config: Config, plan: ClusterPlan, detach: bool) -> int:
    """Start the cluster on Ray; without ``detach``, serve until Ctrl-C / SIGTERM."""
    if not plan.complete:
        raise UpError("hybridlb up places the whole cluster: list every node under data_parallel.nodes "
                      "(or drop data_parallel.size_local for one node)")
    try:
        load_spec(config.engine.model)
    except CheckpointError as exc:
        raise UpError(str(exc)) from None
    if detach and not config.ray.address:
        raise UpError("--detach needs a Ray cluster that outlives this command: start one with "
                      "`ray start --head` and pass --address auto")
    private = not config.ray.address  # a local Ray cluster of our own, gone when we return
    connect(config.ray.address, config.ray.namespace, sum(b["CPU"] for b in Placement(config, plan).bundles))
    if actor_name(config.ray.name, "pg") in _named(config.ray.namespace, prefix=f"hybridlb:{config.ray.name}:"):
        raise UpError(f"a cluster named {config.ray.name!r} is already up; `hybridlb down {config.ray.name}` first")
    cluster = RayCluster(config, plan, detach, private)
    stop = threading.Event()
    started = time.monotonic()
    try:
        cluster.start()
        print(f"hybridlb cluster {config.ray.name!r} is ready in {time.monotonic() - started:.1f} s "
              f"(model {config.served_model_name!r}, {plan.mode} LB, {plan.size} ranks)\n{cluster.table()}", flush=True)
        if detach:
            print(f"detached: `hybridlb status {config.ray.name}` / `hybridlb down {config.ray.name}`", flush=True)
            return 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        return 0
    except BaseException:
        detach = False
        raise
    finally:
        if not detach:
            cluster.stop()
        if private:
            _shutdown_private()


def _shutdown_private() -> None:
    """Stop the Ray cluster ``up`` started, and return only once its processes have exited."""
    ray_processes = lifecycle.descendants()
    ray.shutdown()
    if left := lifecycle.wait_gone(ray_processes, timeout_s=20):
        log.warning("%d processes of the local Ray cluster are still running: %s", len(left), left)


def _remove_runtime_dirs(name: str, group) -> None:
    """Remove the cluster's directory on each of its nodes (one task per bundle)."""
    tasks = [remove_runtime_dir.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index)).remote(name)
        for index in range(len(group.bundle_specs))]
    with contextlib.suppress(Exception):
        ray.get(tasks, timeout=20)


def _named(namespace: str, prefix: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith(prefix)) + _groups(prefix)


def _groups(prefix: str) -> list[str]:
    table = ray.util.placement_group_table()
    return [pg["name"] for pg in table.values() if pg["name"].startswith(prefix) and pg["state"] != "REMOVED"]


def status(name: str, address: str | None, namespace: str) -> list[dict]:
    """Every actor of cluster ``name``: its state, node and (engines) load."""
    connect(address or "auto", namespace)
    from ray.util.state import list_actors

    prefix = f"hybridlb:{name}:"
    rows = []
    for actor in list_actors(filters=[("ray_namespace", "=", namespace)], limit=10_000):
        if not (actor.name or "").startswith(prefix):
            continue
        row = {"name": actor.name, "state": actor.state, "node": (actor.node_id or "")[:12], "load": ""}
        if actor.state == "ALIVE" and ":engine:" in actor.name:
            try:
                stats = ray.get(ray.get_actor(actor.name, namespace).stats.remote(), timeout=5)
                row["load"] = f"running {stats['num_running']}, waiting {stats['num_waiting']}, " \
                              f"kv {stats['kv_usage']:.0%}" + ("" if stats["alive"] else " (engine loop stopped)")
            except Exception as exc:
                row["load"] = f"no answer ({type(exc).__name__})"
        rows.append(row)
    return sorted(rows, key=lambda r: r["name"])


def down(name: str, address: str | None = None, namespace: str = "hybridlb", quiet: bool = False) -> int:
    """Stop and remove every actor and the placement group of cluster ``name``."""
    connect(address or "auto", namespace)
    prefix = f"hybridlb:{name}:"
    names = [n for n in _named(namespace, prefix) if not n.endswith(":pg")]
    for actor_id in names:
        # Ask for a clean stop first (closes sockets), then make sure it is gone.
        with contextlib.suppress(Exception):
            ray.get(ray.get_actor(actor_id, namespace).stop.remote(), timeout=10)
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(actor_id, namespace), no_restart=True)
    groups = _groups(prefix)
    for group_name in groups:
        group = ray.util.get_placement_group(group_name)
        _remove_runtime_dirs(name, group)
        remove_placement_group(group)
    if not quiet:
        print(f"stopped {len(names)} actors and {len(groups)} placement group(s) of {name!r}")
    return 0 if names or groups else 1
