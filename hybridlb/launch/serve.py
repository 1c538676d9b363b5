"""``hybridlb serve``: one node's process tree, no Ray (the llm-d one-pod-per-node shape).

The parent process (``hybridlb:serve``) lays out the cluster (``hybridlb.plan``), then:

1. head node (start rank 0): starts the coordinator when the plan has one, and the
   rpc-port handshake when other nodes will join; any other node joins the head and
   learns the coordinator's addresses (a mismatch ends it with the head's reason);
2. starts this node's engines and waits for each one's readiness handshake;
3. waits for the cluster-wide barrier: every rank on every node is up;
4. starts this node's API servers (none when headless) and waits until they are ready;
5. waits. SIGTERM / Ctrl-C stops everything; so does the death of an API server or,
   on other nodes, losing the head. A dead engine is reported by /health and /ranks.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
import time
from multiprocessing.connection import wait

from hybridlb import lifecycle
from hybridlb.api.app import ApiServerSpec
from hybridlb.api.server import run_api_server
from hybridlb.config import Config
from hybridlb.coordinator import run_coordinator
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.launch import (
    EngineProcess,
    EngineStartError,
    default_torch_threads,
    start_engine,
    stop_engines,
    wait_until_ready,
)
from hybridlb.launch.handshake import ClusterError, HeadHandshake, NodeLink, registration
from hybridlb.plan import ClusterPlan, NodePlan
from hybridlb.protocol import NodeAccepted

log = logging.getLogger("hybridlb.serve")
_spawn = multiprocessing.get_context("spawn")


class NodeStartError(RuntimeError):
    """A component of this node failed to start; the message says which and why."""


class Node:
    """The processes of one node and how to start and stop them."""

    def __init__(self, config: Config, plan: ClusterPlan, node: NodePlan):
        self.config, self.plan, self.node = config, plan, node
        self.runtime_dir = tempfile.mkdtemp(prefix="hybridlb-")
        self.coordinator: multiprocessing.Process | None = None
        self.handshake: HeadHandshake | None = None
        self.link: NodeLink | None = None
        self.engines: list[EngineProcess] = []
        self.apis: list[multiprocessing.Process] = []
        self.started = False
        self.stopping = False
        self.exit_reason: str | None = None

    @property
    def joins_cluster(self) -> bool:
        """Whether nodes must find each other (else each node runs on its own)."""
        return self.plan.multi_node and (self.plan.coordinator or self.plan.mode == "internal")

    def engine_address(self, rank: int) -> str:
        if self.plan.remote_engines:
            return f"tcp://{self.node.address}:{self.plan.engine_port(rank)}"
        return f"ipc://{self.runtime_dir}/engine-{rank}"

    # -- start ------------------------------------------------------------------------
    def start(self, timeout_s: float = 600) -> None:
        shared = self._coordination()
        threads = default_torch_threads(self.config.engine, len(self.node.ranks))
        for rank in self.node.ranks:
            dp = DPContext(rank, self.plan.size, shared.coordinator_stats, shared.coordinator_waves, shared.rendezvous)
            self.engines.append(start_engine(self.config.engine, rank, self.engine_address(rank), threads, dp))
        try:
            wait_until_ready(self.engines, timeout_s)
        except EngineStartError as exc:
            raise NodeStartError(str(exc)) from None
        addresses = self._barrier({e.rank: e.address for e in self.engines}, timeout_s)
        self._start_api_servers(addresses, shared.coordinator_loads, timeout_s)
        self.started = True

    def _coordination(self) -> NodeAccepted:
        """Start (head) or join (other nodes) what the cluster shares; return its addresses."""
        plan = self.plan
        shared = NodeAccepted(
            coordinator_stats=plan.coordinator_stats_address() if plan.coordinator else None,
            coordinator_loads=plan.coordinator_loads_address() if plan.coordinator else None,
            rendezvous=plan.rendezvous_address() if plan.lockstep else None,
            coordinator_waves=plan.coordinator_waves_address() if plan.lockstep else None,
        )
        if self.node.is_head:
            if plan.coordinator:
                args = (shared.coordinator_stats, shared.coordinator_loads, plan.size, shared.coordinator_waves)
                self.coordinator = _spawn.Process(target=run_coordinator, args=args, name="hybridlb:coordinator",
                                                  daemon=True)
                self.coordinator.start()
            if self.joins_cluster:
                own = registration(self.config, 0, len(self.node.ranks), {})
                self.handshake = HeadHandshake(self.config, own, shared)
                self.handshake.start()
            return shared
        if not self.joins_cluster:
            return shared
        self.link = NodeLink(self.config)
        addresses = {rank: self.engine_address(rank) for rank in self.node.ranks}
        own = registration(self.config, self.node.start_rank, len(self.node.ranks), addresses)
        try:
            return self.link.join(own)
        except ClusterError as exc:
            raise NodeStartError(str(exc)) from None

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
            self.link.watch(self._lost_head)
            return {**ready.engine_addresses, **local}
        return local

    def _start_api_servers(self, addresses: dict[int, str], loads: str | None, timeout_s: float) -> None:
        events = []
        ports = [api.port for api in self.node.api_servers]
        if len(ports) > len(set(ports)):  # shared port: one /metrics for all of them
            metrics_dir = os.path.join(self.runtime_dir, "metrics")
            os.makedirs(metrics_dir, exist_ok=True)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        for api in self.node.api_servers:
            spec = ApiServerSpec(tuple((rank, addresses[rank]) for rank in api.ranks), api.name, self.node.index,
                                 self.plan.mode, loads, self.config.lb.policy)
            ready = _spawn.Event()
            process = _spawn.Process(target=run_api_server, name=f"hybridlb:{api.name}", daemon=True,
                                     args=(self.config, spec, api.host, api.port, ports.count(api.port) > 1, ready))
            process.start()
            self.apis.append(process)
            events.append((api, process, ready))
        deadline = time.monotonic() + timeout_s
        for api, process, ready in events:
            while not ready.wait(0.2):
                if not process.is_alive():
                    raise NodeStartError(f"API server {api.name} exited with code {process.exitcode} "
                                         "(see its log above)")
                if time.monotonic() > deadline or self.stopping:
                    raise NodeStartError(f"API server {api.name} was not ready in time")

    # -- run and stop -------------------------------------------------------------------
    def _lost_head(self, reason: str) -> None:
        self.exit_reason = f"{reason}; stopping this node"
        self.stopping = True

    def wait(self) -> int:
        """Block until asked to stop or something essential died; return the exit code."""
        watched = {e.process.sentinel: f"engine {e.rank}" for e in self.engines}
        if self.coordinator is not None:
            watched[self.coordinator.sentinel] = "the coordinator"
        while not self.stopping:
            for api in self.apis:
                if not api.is_alive():
                    self.exit_reason = f"{api.name} exited with code {api.exitcode}; stopping the node"
                    return 1
            for sentinel in wait(list(watched), timeout=0.5):
                log.error("%s exited; /health and /ranks report it", watched.pop(sentinel))
        return 1 if self.exit_reason else 0

    def stop(self) -> None:
        """SIGTERM everything at once (in-flight requests fail either way), then reap."""
        if self.handshake is not None:
            self.handshake.stop("the head node is shutting down")
        for process in [*self.apis, self.coordinator]:
            if process is not None and process.is_alive():
                process.terminate()
        stop_engines(self.engines)
        for process in [*self.apis, self.coordinator]:
            if process is not None:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join()
        if self.link is not None:
            self.link.close()


def _describe(node: NodePlan) -> str:
    ranks = f"rank{'s' if len(node.ranks) > 1 else ''} {node.ranks[0]}" + (
        f"..{node.ranks[-1]}" if len(node.ranks) > 1 else "")
    if node.headless:
        return f"node {node.index} (headless) is up with {ranks}"
    urls = sorted({f"http://{a.host}:{a.port}/v1" for a in node.api_servers})
    return f"node {node.index} serves {ranks} at {', '.join(urls)}"


def serve(config: Config, plan: ClusterPlan, node: NodePlan) -> int:
    """Run this node until SIGTERM / Ctrl-C; return the process exit code."""
    lifecycle.set_title("hybridlb:serve")
    lifecycle.configure_logging(f"hybridlb:serve:{node.index}")
    runner = Node(config, plan, node)

    def terminate() -> None:
        runner.stopping = True
        if not runner.started:  # still starting: interrupt whatever start-up is waiting on
            raise NodeStartError("interrupted while starting")

    lifecycle.on_terminate(terminate)
    try:
        runner.start()
        print(f"hybridlb is ready: {_describe(node)} (model {config.served_model_name!r})", flush=True)
        code = runner.wait()
        if runner.exit_reason:
            log.error("%s", runner.exit_reason)
        return code
    except NodeStartError as exc:
        log.error("%s", exc)
        return 1
    finally:
        runner.stop()
