"""``hybridlb up``: the cluster placed on Ray by one driver (joining Ray: ``ray_session``; ``status`` /
``down`` of a running cluster: ``ray_admin``).

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

import logging
import os
import secrets
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridlb import lifecycle
from hybridlb.api.spec import ApiServerSpec
from hybridlb.checkpoint.spec import CheckpointError, load_spec
from hybridlb.config import Config
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.spawn import node_core_share
from hybridlb.launch.ray_actors import (
    ApiServerActor,
    CoordinatorActor,
    EngineActor,
    SupervisorActor,
    engine_gpus,
    engine_threads,
    free_ports,
)
from hybridlb.launch.ray_admin import down, named
from hybridlb.launch.ray_scaling import ScalerActor
from hybridlb.launch.ray_session import (
    UpError,
    actor_name,
    connect,
    dashboard_line,
    kill_private,
    shutdown_private,
    wait_for,
)
from hybridlb.launch.scaling import resizable
from hybridlb.launch.supervisor import local_url
from hybridlb.plan import ClusterPlan, NodePlan
from hybridlb.transport import cluster_token

log = logging.getLogger("hybridlb.up")


class Placement:
    """One bundle per node: its size, and how to schedule an actor into it."""

    def __init__(self, config: Config, plan: ClusterPlan):
        self.config, self.plan = config, plan
        self.gpus = engine_gpus(config)
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

    def reserve(self, name: str, detached: bool, timeout_s: float, check: Callable[[], None]) -> None:
        strategy = "STRICT_SPREAD" if len(self.bundles) > 1 else "PACK"
        self.group = placement_group(self.bundles, strategy=strategy, name=name,
                                     lifetime="detached" if detached else None)
        try:
            wait_for(self.group.ready(), timeout_s, check)
        except ray.exceptions.GetTimeoutError:
            raise UpError(f"Ray could not place {len(self.bundles)} bundles {self.bundles} within {timeout_s:.0f} s; "
                          "other clusters or tasks may hold the resources (see `hybridlb status` / `ray status`)") \
                from None

    def on(self, node: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=node)


class RayCluster:
    """The actors of one ``up``, started in order and stopped together."""

    def __init__(self, config: Config, plan: ClusterPlan, detached: bool, private: bool = False,
                 check: Callable[[], None] = lambda: None):
        """``private``: on the one-machine Ray cluster ``up`` started itself, so every socket
        binds loopback (as ``serve``'s defaults do). ``check()`` raises to abandon the start-up
        (called between short waits)."""
        self.check = check
        self.config, self.plan, self.detached = config, plan, detached
        self.host = "127.0.0.1" if private else None
        self.name = config.ray.name
        self.placement = Placement(config, plan)
        self.coordinator = None
        self.engines: dict[int, object] = {}
        self.apis: list[tuple[NodePlan, object]] = []
        # restart_policy restart: Ray restarts any actor that dies (a MoE group: see EngineActor). Multi-port
        # keeps a rank's API server alive whatever the policy, and a dense rank's engine (as ``serve`` does).
        restart = config.data_parallel.restart_policy == "restart"
        multi_port = plan.mode == "multi_port"
        self.restarts = -1 if restart or (multi_port and not plan.lockstep) else 0
        self.api_restarts = -1 if restart or multi_port else 0
        self.supervisors: list[object] = []
        self.scaler = None  # a one-node dense cluster's resizer (``launch.ray_scaling``)
        self.token = cluster_token(config.data_parallel.cluster_token)  # actors may not share our environment

    def _options(self, role: str, index=None, node: int = 0, **resources) -> dict:
        return dict(name=actor_name(self.name, role, index), namespace=self.config.ray.namespace,
                    lifetime="detached" if self.detached else None, scheduling_strategy=self.placement.on(node),
                    **resources)

    def start(self) -> None:
        timeout = self.config.ray.ready_timeout_s
        self.placement.check_fits()
        self.placement.reserve(actor_name(self.name, "pg"), self.detached, timeout, self.check)
        shared = self._start_coordinator()
        self._start_engines(shared)
        addresses = dict(zip(self.engines, wait_for([e.address.remote() for e in self.engines.values()],
                                                    timeout, self.check), strict=True))
        scale_control = self._start_scaler(shared, addresses)
        self._start_api_servers(addresses, shared.get("loads"), scale_control)
        self._start_supervisors()
        ready = wait_for([api.wait_ready.remote(timeout) for _, api in self.apis], timeout + 10, self.check)
        if not all(ready):
            raise UpError("an API server never saw all of its engines ready")

    def _start_coordinator(self) -> dict:
        if not self.plan.coordinator:
            return {}
        draw = free_ports.options(scheduling_strategy=self.placement.on(0))
        ip, ports = wait_for(draw.remote(4, self.host, self.plan.named_ports()), 60, self.check)
        if self.host is None and not self.token:
            # Beyond loopback with no cluster token: draw one for this run. The actors get it from
            # this driver through Ray, so only they can reach the coordinator's and engines' sockets.
            self.token = secrets.token_urlsafe(32)
        options = self._options("coordinator", num_cpus=0, max_restarts=self.restarts)
        self.coordinator = CoordinatorActor.options(**options).remote(self.name, self.plan.size, self.plan.lockstep,
                                                                 ip, ports, self.token)
        return wait_for(self.coordinator.addresses.remote(), 60, self.check)

    def _start_engines(self, shared: dict) -> None:
        cfg = self.config
        threads = engine_threads(cfg)
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
                engine = cfg.engine.for_rank(rank, node.http_port(rank), cfg.served_model_name)
                self.engines[rank] = EngineActor.options(**options).remote(self.name, engine, dp, node.index, port,
                                                                      threads, self.host, share)

    def _start_scaler(self, shared: dict, addresses: dict[int, str]) -> tuple[str, bytes] | None:
        """A one-node dense cluster: the actor that resizes it (``launch.ray_scaling``); its socket."""
        if not resizable(self.plan):
            return None
        options = self._options("scaler", None, 0, num_cpus=0)
        self.scaler = ScalerActor.options(**options).remote(self.name, self.config, self.plan, shared, self.token,
                                                            self.host, self.detached, self.restarts,
                                                            sorted(addresses.items()))  # held: it lives as long
        return tuple(wait_for(self.scaler.socket.remote(), 60, self.check))

    def _start_api_servers(self, addresses: dict[int, str], loads: str | None,
                           scale_control: tuple[str, bytes] | None = None) -> None:
        for node in self.plan.nodes:
            ports = [a.port for a in node.api_servers]
            for api in node.api_servers:
                spec = ApiServerSpec(tuple((r, addresses[r]) for r in api.ranks), api.name, node.index,
                                     self.plan.mode, loads, self.config.lb.policy, self.token,
                                     scale_control=scale_control)
                options = self._options("api", api.name.split(":", 1)[1], node.index,
                                        num_cpus=self.config.ray.cpus_per_api_server,
                                        max_restarts=self.api_restarts)
                actor = ApiServerActor.options(**options).remote(self.name, self.config, spec, api.host, api.port,
                                                            ports.count(api.port) > 1)
                self.apis.append((node, actor))

    def _start_supervisors(self) -> None:
        """Multi-port: one supervisor per node, beside its ranks' API servers (``launch.supervisor``)."""
        lb = self.config.lb
        for node in self.plan.nodes:
            if node.supervisor_port is None:
                continue
            children = {api.ranks[0]: local_url(api.host, api.port) for api in node.api_servers}
            options = self._options("supervisor", node.index, node.index, num_cpus=0, max_restarts=-1)
            self.supervisors.append(SupervisorActor.options(**options).remote(
                self.name, node.index, node.api_servers[0].host, node.supervisor_port, children,
                lb.supervisor_probe_interval_s, lb.supervisor_probe_timeout_s, lb.supervisor_probe_failure_threshold))

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
    what = f"cluster {config.ray.name!r}" + (" and its private Ray cluster" if private else "")
    force = kill_private if private else lambda: None
    connecting = True

    def on_stop() -> None:
        # While Ray itself starts, nothing of the cluster exists yet, and ray.init cannot be interrupted
        # (the same Ctrl-C may have killed the daemons it waits for): drop what it started, now.
        if connecting:
            force()
            os._exit(1)

    # Ray's waits cannot take an exception from a signal handler: start-up polls the signals instead.
    signals = lifecycle.StopSignals(what, force=force, on_stop=on_stop, interrupt=False)
    cluster = None
    started = time.monotonic()
    try:
        connect(config.ray.address, config.ray.namespace, sum(b["CPU"] for b in Placement(config, plan).bundles))
        connecting = False
        signals.install()  # ray.init sets a SIGTERM handler of its own
        signals.check()
        if actor_name(config.ray.name, "pg") in named(config.ray.namespace, prefix=f"hybridlb:{config.ray.name}:"):
            raise UpError(f"a cluster named {config.ray.name!r} is already up; `hybridlb down {config.ray.name}` "
                          "first")
        cluster = RayCluster(config, plan, detach, private, check=signals.check)
        cluster.start()
        signals.starting = False
        print(f"hybridlb cluster {config.ray.name!r} is ready in {time.monotonic() - started:.1f} s "
              f"(model {config.served_model_name!r}, {plan.mode} LB, {plan.size} ranks)\n{cluster.table()}\n"
              f"{dashboard_line(private)}", flush=True)
        if detach:
            print(f"detached: `hybridlb status {config.ray.name}` / `hybridlb down {config.ray.name}`", flush=True)
            return 0
        while not signals.requested:
            time.sleep(0.2)
        return 0
    except lifecycle.Interrupted:
        detach = False
        return 1
    except Exception as exc:
        detach = False
        if not signals.requested:
            raise
        # The Ctrl-C reached Ray's own processes too (the terminal's whole group) and one starting
        # gave up: that is the stop asked for, not a failure to report.
        log.info("stopped while starting (%s)", type(exc).__name__)
        return 1
    except BaseException:
        detach = False
        raise
    finally:
        signals.starting = False
        if cluster is not None and not detach:
            cluster.stop()
        if private and ray.is_initialized():
            shutdown_private()
