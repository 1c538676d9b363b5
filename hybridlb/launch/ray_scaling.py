"""Resizing a cluster ``hybridlb up`` placed on Ray: the resize of a ``serve`` node
(``hybridlb.launch.scaling``: one at a time, grow = start, wait ready, then traffic; shrink =
drain, move what runs, then stop), carried out by a named actor of the cluster,
``hybridlb:<name>:scaler``, on the node's bundle. Its API servers connect to it as a ``serve``
node's do to the launcher (a Unix socket in the node's runtime directory), so
``POST /scale_elastic_ep`` works the same; ``hybridlb scale NAME --data-parallel-size N`` calls
it through Ray (a detached cluster has no driver left to ask).

New ranks are engine actors (``hybridlb:<name>:engine:<rank>``, so ``status`` and ``down`` find
them) pinned to the node the cluster runs on, each taking ``ray.cpus_per_engine`` CPUs of it
outside the cluster's placement group (a placement group cannot grow). A node is resizable as a
``serve`` node is: one node, dense, not multi-port.
"""

from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hybridlb.engine.dp_context import DPContext
from hybridlb.launch.autoscale import start_autoscaler
from hybridlb.launch.ray_actors import EngineActor, engine_gpus, engine_threads, runtime_dir
from hybridlb.launch.ray_session import UpError, actor_name, attach
from hybridlb.launch.scaling import START_TIMEOUT_S, ScaleControl, ScaleError, send_rank_count

log = logging.getLogger("hybridlb.up")
STOP_TIMEOUT_S = 10.0


class RayRanks:
    """A Ray cluster's ranks, as ``ScaleControl`` starts and stops them."""

    room_unit = "ray.cpus_per_engine CPUs each of its Ray node"

    def __init__(self, cluster: str, config, plan, shared: dict, token: str | None, host: str | None,
                 detached: bool, restarts: int, engines: list[tuple[int, str]]):
        self.cluster, self.config, self.plan, self.shared, self.token = cluster, config, plan, shared, token
        self.host, self.detached, self.restarts = host, detached, restarts
        self.engines = list(engines)  # (rank, address): what a restarted API server should front
        self.actors: dict = {}  # the engine actors it started, held: a non-detached actor lives as long as a handle
        self.node_id = ray.get_runtime_context().get_node_id()  # the scaler runs on the cluster's node

    def count(self) -> int:
        return len(self.engines)

    def capacity(self) -> int:
        """Ranks the node holds at ``ray.cpus_per_engine`` each: its CPUs (the running ranks' included)."""
        cpus = next((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["NodeID"] == self.node_id), 0)
        return max(len(self.engines), int(cpus // max(self.config.ray.cpus_per_engine, 1e-9)))

    def start(self, ranks: range, size: int) -> list[tuple[int, str]]:
        cfg = self.config
        threads, gpus = engine_threads(cfg), engine_gpus(cfg)
        node = self.plan.nodes[0]
        started = {}
        for rank in ranks:
            dp = DPContext(rank, size, self.shared.get("stats"), self.shared.get("waves"),
                           self.shared.get("rendezvous"), self.token)
            engine = cfg.engine.for_rank(rank, node.http_port(node.ranks[0]), cfg.served_model_name)
            options = dict(name=actor_name(self.cluster, "engine", rank), namespace=cfg.ray.namespace,
                           lifetime="detached" if self.detached else None, num_cpus=cfg.ray.cpus_per_engine,
                           num_gpus=gpus, max_restarts=self.restarts,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False))
            started[rank] = EngineActor.options(**options).remote(self.cluster, engine, dp, node.index, None,
                                                                  threads, self.host)
        log.info("growing to %d ranks: starting engine actors %s", size, list(started))
        try:
            addresses = ray.get([actor.address.remote() for actor in started.values()], timeout=START_TIMEOUT_S)
        except Exception as exc:  # Ray found no room within the time, or an engine failed to load
            for actor in started.values():
                ray.kill(actor, no_restart=True)
            why = (f"Ray could not place or start them within {START_TIMEOUT_S:.0f} s"
                   if isinstance(exc, ray.exceptions.GetTimeoutError) else _first_line(exc))
            raise ScaleError(500, f"the resize to {size} ranks failed and was rolled back: {why}") from None
        added = list(zip(started, addresses, strict=True))
        self.actors.update(started)
        self.engines.extend(added)
        return added

    def stop(self, ranks: list[int]) -> None:
        for rank in ranks:
            actor = self.actors.pop(rank, None)
            if actor is None:  # one the cluster started with: the driver holds it, and Ray finds it by name
                try:
                    actor = ray.get_actor(actor_name(self.cluster, "engine", rank), self.config.ray.namespace)
                except ValueError:  # already gone
                    continue
            try:
                ray.get(actor.stop.remote(), timeout=STOP_TIMEOUT_S)
            except Exception as exc:  # a dead engine: killing it is all that is left
                log.warning("engine %d did not stop cleanly (%s); killing it", rank, type(exc).__name__)
            ray.kill(actor, no_restart=True)
        self.engines = [(rank, address) for rank, address in self.engines if rank not in ranks]

    def respec(self, change) -> None:
        """Ray restarts an API server with the engines it first had: ``ScaleControl`` tells a
        (re)connecting one the current set (``current``)."""

    def current(self) -> list[tuple[int, str]]:
        return list(self.engines)

    def tell_coordinator(self, size: int) -> None:
        if self.shared.get("stats"):
            send_rank_count(self.shared["stats"], self.token, size)


def _first_line(exc: Exception) -> str:
    """An actor's failure in one line (Ray's own text carries the remote traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


@ray.remote(num_cpus=0, max_concurrency=4)
class ScalerActor:
    """``hybridlb:<name>:scaler``: the cluster's ``ScaleControl`` (threads of this actor)."""

    def __init__(self, cluster: str, config, plan, shared: dict, token: str | None, host: str | None,
                 detached: bool, restarts: int, engines: list[tuple[int, str]]):
        self.cluster = cluster
        self.ranks = RayRanks(cluster, config, plan, shared, token, host, detached, restarts, engines)
        self.control = ScaleControl(self.ranks, runtime_dir(cluster))
        # an autoscaling section: the same autoscaler as a serve node's, on the coordinator's loads
        self.autoscaler = start_autoscaler(config, self.control, shared.get("loads"), token)

    def socket(self) -> tuple[str, bytes]:
        """Where the cluster's API servers connect, and the key."""
        return self.control.address, self.control.key

    def scale(self, size: int, drain_timeout_s: float) -> tuple[int, str]:
        """(HTTP status, message), as ``POST /scale_elastic_ep`` would answer."""
        try:
            return 200, self.control.scale(size, drain_timeout_s, trigger="cli")
        except ScaleError as exc:
            return exc.status, str(exc)

    def size(self) -> int:
        return self.control.size

    def stop(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.stop()
        self.control.close()

    def __repr__(self) -> str:
        return f"scaler cluster={self.cluster} ranks={self.control.size}"


def scale(name: str, size: int, drain_timeout_s: float, address: str | None, namespace: str) -> str:
    """``hybridlb scale``: resize cluster ``name`` to ``size`` ranks; its answer, or UpError saying why not."""
    attach(address, namespace)
    try:
        scaler = ray.get_actor(actor_name(name, "scaler"), namespace)
    except ValueError:
        raise UpError(f"no resizable cluster named {name!r} in namespace {namespace!r} (`hybridlb status {name}`; "
                      "only a one-node cluster of a dense model, not multi-port, can be resized)") from None
    status, message = ray.get(scaler.scale.remote(size, drain_timeout_s))
    if status != 200:
        raise UpError(message)
    return message
