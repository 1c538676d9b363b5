"""``hybridlb serve``: one node's process tree, no Ray (the llm-d one-pod-per-node shape).

The parent process (``hybridlb:serve``) lays out the cluster (``hybridlb.plan``), then:

1. head node (start rank 0): starts the coordinator when the plan has one, and the
   rpc-port handshake when other nodes will join; any other node joins the head and
   learns the coordinator's addresses (a mismatch ends it with the head's reason);
2. starts this node's engines, and its API server processes (none when headless), which load
   their modules meanwhile (``hybridlb.launch.api_processes``); waits for each engine's
   readiness handshake;
3. waits for the cluster-wide barrier: every rank on every node is up;
4. tells the API servers their engines and waits until they are ready;
5. watches its processes until SIGTERM / Ctrl-C (which stops everything).

What happens when a part dies (``data_parallel.restart_policy``; a part that dies more than
``MAX_RESTARTS`` times in ``RESTART_WINDOW_S`` is left dead, so a crash loop ends) is
docs/failure-model.md's table; resizing a running node is ``hybridlb.launch.scaling``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import time
from multiprocessing.connection import wait

import msgspec

from hybridlb import lifecycle
from hybridlb.api.spec import ApiServerSpec
from hybridlb.config import Config
from hybridlb.coordinator import run_coordinator
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.spawn import (
    EngineProcess,
    EngineStartError,
    default_torch_threads,
    node_core_share,
    start_engine,
    stop_engines,
    wait_until_ready,
)
from hybridlb.launch.api_processes import ApiProcesses, NodeStartError
from hybridlb.launch.autoscale import start_autoscaler
from hybridlb.launch.handshake import ClusterError, HeadHandshake, registration
from hybridlb.launch.node_link import NodeLink
from hybridlb.launch.scaling import MainThreadCalls, ProcessRanks, ScaleControl, growth_room, send_rank_count
from hybridlb.launch.supervisor import Supervisor, local_url
from hybridlb.netaddr import route_to
from hybridlb.plan import ClusterPlan, NodePlan
from hybridlb.protocol import NodeAccepted
from hybridlb.transport import cluster_token

log = logging.getLogger("hybridlb.serve")
_spawn = multiprocessing.get_context("spawn")
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


class Node:
    """The processes of one node and how to start and stop them."""

    def __init__(self, config: Config, plan: ClusterPlan, node: NodePlan, sockets: dict | None = None):
        self.config, self.plan, self.node = config, plan, node
        self.sockets = dict(sockets or {})  # API server name → its socket, bound before anything started
        self.runtime_dir = lifecycle.private_dir()  # engine sockets, metrics files; removed at stop
        self.coordinator: multiprocessing.Process | None = None
        self.handshake: HeadHandshake | None = None
        self.link: NodeLink | None = None
        self.engines: list[EngineProcess] = []
        self.engine_args: dict[int, tuple] = {}  # rank → what start_engine got (to restart it)
        self.coordinator_args: tuple = ()
        self.api = ApiProcesses(config, node, self.runtime_dir, self.sockets)
        self.apis, self.api_args = self.api.processes, self.api.args  # the same lists
        self.restarts: dict[str, list[float]] = {}
        self.supervisor: Supervisor | None = None
        self.scaling: ScaleControl | None = None  # resizes asked for through the API servers
        self.autoscaler = None  # the config's autoscaling section at work (hybridlb.launch.autoscale)
        self.main_thread = MainThreadCalls()  # what a resize starts, started by the thread that waits
        self.shared: NodeAccepted | None = None
        self.token = cluster_token(config.data_parallel.cluster_token)
        self.started = False
        self.stopping = False
        self.exit_reason: str | None = None
        self.restart_anew: str | None = None  # why this node must stop and start again from scratch

    @functools.cached_property
    def address(self) -> str:
        """Where other nodes reach this one: as configured, else the address routing to the head."""
        return self.node.address or route_to(self.plan.head_address, self.plan.rpc_port)

    def engine_address(self, rank: int) -> str:
        if self.plan.remote_engines:
            return f"tcp://{self.address}:{self.plan.engine_port(rank)}"
        return f"ipc://{self.runtime_dir}/engine-{rank}"

    def keeps_alive(self, part: str) -> bool:
        """Multi-port brings a rank's dead part back in place whatever restart_policy says (the
        other ranks keep the pod ready meanwhile), where vLLM tears down the node: its API server
        always, its engine on a dense model (an expert-parallel group fails together, as everywhere)."""
        if self.plan.mode != "multi_port":
            return False
        return part.startswith("api") or not self.plan.lockstep

    # -- start ------------------------------------------------------------------------
    def start(self, timeout_s: float = 600) -> None:
        self._start_supervisor()
        self.shared = shared = self._coordination()
        threads = default_torch_threads(self.config.engine, len(self.node.ranks))
        cores = node_core_share(self.config.engine, self.runtime_dir, "cores", len(self.node.ranks),
                                table=growth_room(self.plan))
        for rank, share in zip(self.node.ranks, cores, strict=True):
            dp = DPContext(rank, self.plan.size, shared.coordinator_stats, shared.coordinator_waves, shared.rendezvous,
                           self.token, self.address if self.plan.lockstep else None)
            engine = self.config.engine.for_rank(rank, self.node.http_port(rank), self.config.served_model_name)
            self.engine_args[rank] = (engine, rank, self.engine_address(rank), threads, dp, share)
            self.engines.append(start_engine(*self.engine_args[rank]))
        self.api.spawn()  # their imports take most of a second: done while the engines load
        try:
            wait_until_ready(self.engines, timeout_s, self.token)
        except EngineStartError as exc:
            raise NodeStartError(str(exc)) from None
        addresses = self._barrier({e.rank: e.address for e in self.engines}, timeout_s)
        if self.node.api_servers:
            self.scaling = ScaleControl(ProcessRanks(self), self.runtime_dir)
            self.autoscaler = start_autoscaler(self.config, self.scaling, shared.coordinator_loads, self.token)
        self._start_api_servers(addresses, shared.coordinator_loads, timeout_s)
        if self.supervisor is not None and not self.supervisor.wait_ready(60):
            raise NodeStartError(f"the supervisor does not see every rank up: {self.supervisor.view()['ranks']}")
        self.started = True

    def _start_supervisor(self) -> None:
        """Multi-port: answer the node's probes (503 until every rank is up) from the start."""
        if self.node.supervisor_port is None:
            return
        lb = self.config.lb
        host = self.config.api.host
        children = {api.ranks[0]: local_url(host, api.port) for api in self.node.api_servers}
        self.supervisor = Supervisor(host, self.node.supervisor_port, children, lb.supervisor_probe_interval_s,
                                     lb.supervisor_probe_timeout_s, lb.supervisor_probe_failure_threshold,
                                     pid_of=self.api.pid_of)
        self.supervisor.start()
        log.info("supervisor of ranks %s at http://%s:%d/readyz", list(children), host, self.node.supervisor_port)

    def _coordination(self) -> NodeAccepted:
        """Start (head) or join (other nodes) what the cluster shares; return its addresses."""
        plan = self.plan
        shared = NodeAccepted(
            coordinator_stats=plan.coordinator_stats_address() if plan.coordinator else None,
            coordinator_loads=plan.coordinator_loads_address() if plan.coordinator else None,
            rendezvous=plan.rendezvous_address() if plan.lockstep else None,
            coordinator_waves=plan.coordinator_waves_address() if plan.lockstep else None,
        )
        if not plan.multi_node:  # one node: no TCP listener a local user could feed forged stats or waves
            ipc = f"ipc://{self.runtime_dir}/coordinator"
            shared = msgspec.structs.replace(
                shared, coordinator_stats=f"{ipc}-stats" if plan.coordinator else None,
                coordinator_loads=f"{ipc}-loads" if plan.coordinator else None,
                coordinator_waves=f"{ipc}-waves" if plan.lockstep else None)
        if self.node.is_head:
            if self.plan.joins_cluster and self.token is None:
                # No cluster token: draw one for this run, so that only the nodes the handshake
                # accepts (they get it in NodeAccepted) can reach the cluster's sockets.
                self.token = secrets.token_urlsafe(32)
                shared = msgspec.structs.replace(shared, session_key=self.token)
            if plan.coordinator:
                self.coordinator_args = (shared.coordinator_stats, shared.coordinator_loads, plan.size,
                                         shared.coordinator_waves, self.token)
                self._start_coordinator()
            if self.plan.joins_cluster:
                own = registration(self.config, 0, len(self.node.ranks), {})
                grows = not plan.lockstep and plan.mode in ("hybrid", "multi_port")  # each node serves its own
                self.handshake = HeadHandshake(self.config, own, shared, self.tell_coordinator if grows else None)
                self.handshake.start()
            return shared
        if not self.plan.joins_cluster:
            return shared
        self.link = NodeLink(self.config)
        addresses = {rank: self.engine_address(rank) for rank in self.node.ranks}
        own = registration(self.config, self.node.start_rank, len(self.node.ranks), addresses)
        try:
            shared = self.link.join(own)
        except ClusterError as exc:
            raise NodeStartError(str(exc)) from None
        self.token = self.token or shared.session_key or None
        return shared

    def tell_coordinator(self, size: int) -> None:
        """Head: the cluster has ``size`` ranks now (a resize, a node that joined with the next
        ranks or whose last ones left)."""
        if self.coordinator_args:
            stats_address, loads, _, waves, token = self.coordinator_args
            self.coordinator_args = (stats_address, loads, size, waves, token)  # a restarted one starts so
            send_rank_count(stats_address, token, size)

    def _start_coordinator(self) -> None:
        self.coordinator = _spawn.Process(target=run_coordinator, args=self.coordinator_args,
                                          name="hybridlb:coordinator", daemon=True)
        with lifecycle.spawning():
            self.coordinator.start()

    def _barrier(self, local: dict[int, str], timeout_s: float) -> dict[int, str]:
        """Wait until every rank of the cluster is up; return the engine address of each rank."""
        if self.handshake is not None:
            self.handshake.mark_local_ready(local)
            log.info("waiting for the other nodes to come up")
            if not self.handshake.cluster_ready.wait(timeout_s):
                missing = sorted(set(range(self.plan.size)) - self.handshake.ready_ranks)
                raise NodeStartError(f"ranks {missing} never came up within {timeout_s:.0f} s")
            return dict(self.handshake.engine_addresses)
        if self.link is not None:
            try:
                ready = self.link.wait_cluster_ready(self.node.start_rank, timeout_s)
            except ClusterError as exc:
                raise NodeStartError(str(exc)) from None
            independent = not (self.plan.lockstep or self.plan.remote_engines)  # dense hybrid: rejoins
            self.link.watch(self._lost_head, self._head_back if independent else None)
            return {**ready.engine_addresses, **local}
        return local

    def _start_api_servers(self, addresses: dict[int, str], loads: str | None, timeout_s: float) -> None:
        specs = [ApiServerSpec(tuple((rank, addresses[rank]) for rank in api.ranks), api.name, self.node.index,
                               self.plan.mode, loads, self.config.lb.policy, self.token, self.api.metrics_dir,
                               (self.scaling.address, self.scaling.key) if self.scaling else None)
                 for api in self.node.api_servers]
        self.api.start(specs, timeout_s, lambda: self.stopping)

    # -- run and stop -------------------------------------------------------------------
    def _lost_head(self, reason: str) -> None:
        if self.plan.lockstep or self.plan.remote_engines:
            self.exit_reason = f"{reason}; stopping this node (it cannot serve without the head)"
            self.stopping = True
            self.main_thread.wake()
        else:
            log.error("%s; this node's ranks are independent and keep serving", reason)

    def _head_back(self, accepted: NodeAccepted) -> bool:
        """A head answers again (a healed link, or a restarted head): whether this node can
        rejoin as it runs. A restarted head without a cluster token drew a new key for the
        cluster's sockets, which this node's processes do not have: then the node restarts
        them all (``restart_anew``) and registers again from scratch."""
        if self.stopping:
            return False
        if (accepted.session_key or None) == self.token or cluster_token(self.config.data_parallel.cluster_token):
            log.warning("the head answers again: rejoining the cluster with ranks %s", self.node.ranks)
            return True
        self.restart_anew = ("the head restarted and drew a new key for the cluster's sockets; restarting this "
                             "node's processes to take it (with a cluster token, nodes rejoin a restarted head "
                             "without restarting)")
        log.warning("%s", self.restart_anew)
        self.stopping = True
        self.main_thread.wake()
        return False

    def wait(self) -> int:
        """Block until asked to stop or the node can no longer serve; return the exit code."""
        on_death = {"engine": self._engine_died, "api": self._api_died, "coordinator": self._coordinator_died}
        handled: set = set()  # dead processes dealt with; not sentinels, whose numbers a restart reuses
        while not self.stopping:
            self.main_thread.run_pending()
            watched = {e.process.sentinel: ("engine", e, e.process) for e in self.engines}
            watched.update({p.sentinel: ("api", i, p) for i, p in enumerate(self.apis)})
            if self.coordinator is not None:
                watched[self.coordinator.sentinel] = ("coordinator", 0, self.coordinator)
            for sentinel in wait([self.main_thread.readable,
                                  *(s for s, (*_, p) in watched.items() if p not in handled)], timeout=0.5):
                if self.stopping:  # Ctrl-C reaches every process of the group: their exits are expected
                    break
                if sentinel not in watched:  # the wake: a call to run, or the stop
                    continue
                kind, index, process = watched[sentinel]
                handled.add(process)
                if not on_death[kind](index):
                    return 1
        return 1 if self.exit_reason else 0

    def _may_restart(self, part: str) -> bool:
        """Whether the policy allows bringing ``part`` back now (no crash loop)."""
        wanted = self.config.data_parallel.restart_policy == "restart" or self.keeps_alive(part)
        if not wanted or self.stopping:
            return False
        now = time.monotonic()
        recent = [t for t in self.restarts.get(part, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= MAX_RESTARTS:
            log.error("%s died %d times within %.0f s; leaving it dead", part, len(recent) + 1, RESTART_WINDOW_S)
            return False
        self.restarts[part] = [*recent, now]
        return True

    def _engine_died(self, engine: EngineProcess) -> bool:
        if engine not in self.engines:  # retired by a resize (hybridlb.launch.scaling): its exit was asked for
            return True
        index = self.engines.index(engine)
        part, why = f"engine {engine.rank}", f"engine {engine.rank} {lifecycle.reap(engine.process)}"  # reaped now
        log.error("%s", why)
        restarting = not self.plan.lockstep and self._may_restart(part)
        self._rank_down(engine.rank, why, restarting)
        if self.plan.lockstep:
            if self.config.data_parallel.restart_policy == "restart":
                self.exit_reason = (f"{part} died and broke the expert-parallel group; exiting so that the "
                                    "node's supervisor recreates the group")
                return False
            return True
        if restarting:
            log.warning("restarting %s", part)
            self.engines[index] = start_engine(*self.engine_args[engine.rank])
        return True

    def _coordinator_died(self, _: int) -> bool:
        log.error("the coordinator %s", lifecycle.reap(self.coordinator))
        if self._may_restart("the coordinator"):
            log.warning("restarting the coordinator")
            self._start_coordinator()
        return True

    def _rank_down(self, rank: int, why: str, restarting: bool) -> bool:
        """Multi-port: tell the supervisor a rank comes back (it stays live) or is left dead (liveness fails)."""
        if self.supervisor is None or rank not in self.supervisor.children:
            return False
        (self.supervisor.mark_restarting if restarting else self.supervisor.mark_failed)(rank, why)
        return True

    def _api_died(self, index: int) -> bool:
        process = self.apis[index]
        part = process.name.removeprefix("hybridlb:")
        why = f"{part} {lifecycle.reap(process)}"
        log.error("%s", why)
        restarting = self._may_restart(part)
        supervised = self._rank_down(self.api_args[index][1].engines[0][0], why, restarting)
        if restarting:
            log.warning("restarting %s", part)
            self.api.respawn(index)
        elif not supervised:  # multi-port: the other ranks serve on until the pod's liveness probe restarts it
            self.exit_reason = f"{why}; stopping the node"
        return restarting or supervised

    def request_stop(self) -> None:
        """Signal-safe: make ``wait`` (and a start-up wait) return."""
        self.stopping = True
        self.main_thread.wake()
        self.main_thread.wake()

    def kill(self) -> None:
        """Now, without waiting: SIGKILL every process of this node and remove its runtime directory."""
        for process in [*self.apis, self.coordinator, *(engine.process for engine in self.engines)]:
            if process is not None and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def stop(self) -> None:
        """SIGTERM everything at once (in-flight requests fail either way), then reap."""
        if self.autoscaler is not None:
            self.autoscaler.stop()
        if self.scaling is not None:
            self.scaling.close()
        if self.supervisor is not None:
            self.supervisor.begin_shutdown()
        if self.handshake is not None:
            self.handshake.stop("the head node is shutting down")
        for process in self.apis:
            if process.is_alive():
                process.terminate()
        if self.started and self.config.api.shutdown_timeout_s:  # requests in flight finish first
            deadline = time.monotonic() + self.config.api.shutdown_timeout_s + 5
            for process in self.apis:
                process.join(max(0.0, deadline - time.monotonic()))
        if self.coordinator is not None and self.coordinator.is_alive():
            self.coordinator.terminate()
        stop_engines(self.engines)
        for process in [*self.apis, self.coordinator]:
            if process is not None:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join()
        if self.link is not None:
            self.link.leave()  # the head drops this node's ranks (a cluster's last ones: it shrinks)
        if self.supervisor is not None:
            self.supervisor.stop()
        for sock in self.sockets.values():  # never handed over: the start failed before the API servers
            sock.close()
        self.main_thread.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
