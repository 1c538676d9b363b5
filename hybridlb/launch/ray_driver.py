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
import secrets
import signal
import socket
import time
from collections.abc import Callable

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
    SupervisorActor,
    free_ports,
    remove_runtime_dir,
)
from hybridlb.launch.supervisor import local_url
from hybridlb.plan import ClusterPlan, NodePlan
from hybridlb.transport import cluster_token

log = logging.getLogger("hybridlb.up")


class UpError(RuntimeError):
    """The cluster cannot be placed or started; the message says why and what to change."""


def actor_name(cluster: str, role: str, index: int | str | None = None) -> str:
    return f"hybridlb:{cluster}:{role}" + ("" if index is None else f":{index}")


_ray_context = None  # what ray.init returned (its dashboard URL)


def connect(address: str | None, namespace: str, num_cpus: float | None = None) -> None:
    """Join the Ray cluster at ``address``, or start a private local one with at least
    ``num_cpus`` logical CPUs (Ray's unit of placement, not a thread count: engines set
    their torch threads themselves), so the config fits however many cores this machine has."""
    global _ray_context
    if ray.is_initialized():
        return
    local = {}
    if not address:
        local = {"num_cpus": max(os.cpu_count() or 1, math.ceil(num_cpus or 0)), "include_dashboard": True}
    _ray_context = ray.init(address=address or "local", namespace=namespace, log_to_driver=False, **local)


def ray_address_file() -> str:
    """Where ``ray start`` records the address of this machine's Ray cluster (Ray's own rule)."""
    temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(temp, "ray", "ray_current_cluster")


def attach(address: str | None, namespace: str) -> None:
    """Join a running Ray cluster for ``status`` / ``down``: ``address``, else ``RAY_ADDRESS``, else
    the one ``ray start`` recorded on this machine. UpError with one line saying why not (none
    running, a stale address file, the cluster's token needed), never a Ray traceback."""
    if ray.is_initialized():
        return
    source = "--address"
    if not address:
        address, source = os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS"
    if not address or address == "auto":
        address, source = _recorded_address(), ray_address_file()
    if not address:
        raise UpError("no Ray cluster is running on this machine (nothing recorded in "
                      f"{ray_address_file()}); a cluster `hybridlb up` started without --address is private to "
                      "that command: ask its API server with `hybridlb status --url http://127.0.0.1:8000`")
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not _answers(host or "127.0.0.1", int(port)):
        stale = "" if source in ("--address", "RAY_ADDRESS") else \
            " (a stale address file, left by a cluster that is gone: ignored; remove it, or pass --address)"
        raise UpError(f"no Ray cluster answers at {address}, the address from {source}{stale}")
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:  # Ray raises many kinds here; the user needs one line, not its stack
        raise UpError(_attach_failure(address, exc)) from None


def _recorded_address() -> str | None:
    try:
        with open(ray_address_file()) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _answers(host: str, port: int) -> bool:
    """Whether anything accepts a TCP connection at host:port (a cluster that is gone does not)."""
    try:
        socket.create_connection((host, port), timeout=3).close()
        return True
    except OSError:
        return False


def _attach_failure(address: str, exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "authentication" in str(exc).lower() or "token" in str(exc).lower():
        return (f"the Ray cluster at {address} requires its authentication token: run this where `ray "
                "get-auth-token` prints it (~/.ray/auth_token), or set RAY_AUTH_TOKEN to it")
    return f"cannot join the Ray cluster at {address}: {type(exc).__name__}: {text[:300]}"


def wait_for(refs, timeout_s: float, check: Callable[[], None]):
    """``ray.get(refs)``, waiting in short slices and calling ``check()`` between them (it raises to
    give up: a stop asked for). A signal handler cannot raise out of Ray's own blocking wait, so a
    launcher that must stop mid start-up polls instead."""
    pending = refs if isinstance(refs, list) else [refs]
    deadline = time.monotonic() + timeout_s
    while True:
        _, waiting = ray.wait(pending, num_returns=len(pending), timeout=0.25)
        if not waiting:
            return ray.get(refs)
        check()
        if time.monotonic() > deadline:
            raise ray.exceptions.GetTimeoutError(f"not ready within {timeout_s:.0f} s")


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
        self._start_api_servers(addresses, shared.get("loads"))
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
                engine = cfg.engine.for_rank(rank, node.http_port(rank), cfg.served_model_name)
                self.engines[rank] = EngineActor.options(**options).remote(self.name, engine, dp, node.index, port,
                                                                      threads, self.host, share)

    def _start_api_servers(self, addresses: dict[int, str], loads: str | None) -> None:
        for node in self.plan.nodes:
            ports = [a.port for a in node.api_servers]
            for api in node.api_servers:
                spec = ApiServerSpec(tuple((r, addresses[r]) for r in api.ranks), api.name, node.index,
                                     self.plan.mode, loads, self.config.lb.policy, self.token)
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
    force = _kill_private if private else lambda: None
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
        if actor_name(config.ray.name, "pg") in _named(config.ray.namespace, prefix=f"hybridlb:{config.ray.name}:"):
            raise UpError(f"a cluster named {config.ray.name!r} is already up; `hybridlb down {config.ray.name}` "
                          "first")
        cluster = RayCluster(config, plan, detach, private, check=signals.check)
        cluster.start()
        signals.starting = False
        print(f"hybridlb cluster {config.ray.name!r} is ready in {time.monotonic() - started:.1f} s "
              f"(model {config.served_model_name!r}, {plan.mode} LB, {plan.size} ranks)\n{cluster.table()}\n"
              f"{_dashboard_line(private)}", flush=True)
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
            _shutdown_private()


def _dashboard_line(private: bool) -> str:
    """Where the Ray dashboard is and how to open it (Ray asks for its token when token auth is on)."""
    url = getattr(_ray_context, "dashboard_url", None) or ""
    if not url:
        return "Ray dashboard: not running (start Ray with its dashboard to see the actors)"
    line = f"Ray dashboard: {url if url.startswith('http') else 'http://' + url}"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        line += (" - it asks for this cluster's token: `ray get-auth-token` prints it (it is kept in "
                 "~/.ray/auth_token)")
    return line + ("; it closes with this command" if private else "")


def _kill_private() -> None:
    """Ctrl-C twice: SIGKILL the private Ray cluster (every process this driver started) now."""
    for pid in lifecycle.descendants():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


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
    attach(address, namespace)
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
    attach(address, namespace)
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
