"""The Ray actors of ``hybridlb up``: thin shells that run the same components as
``hybridlb serve`` (EngineShell, the FastAPI app, Coordinator) in a thread of the actor
process, speaking the same wire protocol. Each binds its sockets itself and reports the
addresses it got, so ports never collide. Classes are named for their role
(``CoordinatorActor``, ``EngineActor``, ``ApiServerActor``) and have a ``__repr__`` with
role, rank and node, which the Ray dashboard shows.

Heavy imports happen inside the actors, so an API server actor never imports torch.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import threading

import ray

from hybridlb.netaddr import quiet_port_band


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


def _runtime_path(cluster: str) -> str:
    from hybridlb import lifecycle

    return os.path.join(lifecycle.socket_tmpdir(), f"hybridlb-ray-{cluster}")


def runtime_dir(cluster: str) -> str:
    """This machine's private directory (0700) of cluster ``cluster``: engine sockets, metrics files."""
    from hybridlb import lifecycle

    return lifecycle.private_dir(_runtime_path(cluster))


def engine_threads(config) -> int:
    """An engine actor's torch threads: ``engine.torch_threads``, else its Ray CPUs (at least 1)."""
    return config.engine.torch_threads or max(1, int(config.ray.cpus_per_engine))


def engine_gpus(config) -> float:
    """An engine actor's Ray GPUs: ``ray.gpus_per_engine``, else 1 on CUDA and 0 elsewhere."""
    gpus = config.ray.gpus_per_engine
    return gpus if gpus is not None else (1.0 if config.engine.device == "cuda" else 0.0)


@ray.remote(num_cpus=0)
def remove_runtime_dir(cluster: str) -> None:
    """Run on each node by ``down``: nothing of the cluster stays in the temporary folder."""
    shutil.rmtree(_runtime_path(cluster), ignore_errors=True)


@ray.remote(num_cpus=0)
def free_ports(count: int, host: str | None = None, avoid: frozenset[int] = frozenset()) -> tuple[str, list[int]]:
    """``host`` (default: this node's IP) and ``count`` ports free on it now (the coordinator's,
    fixed before it starts so that a restarted coordinator binds the same addresses its peers know).

    Drawn below the kernel's ephemeral range (where every outgoing connection of the node's Ray
    processes takes its port) and above Ray's worker ports, so none of them is taken between this
    draw and the coordinator's bind; the ephemeral range only where that band is full. ``avoid``:
    ports the plan names (API servers', engines'), free now but bound later by their owners."""
    ip = host or _node_ip()
    sockets: list[socket.socket] = []
    try:
        band = quiet_port_band()
        for port in random.sample(band, min(64, len(band))):
            if port in avoid:
                continue
            s = socket.socket()
            try:
                s.bind((ip, port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            if len(sockets) == count:
                break
        while len(sockets) < count:
            sockets.append(socket.socket())
            sockets[-1].bind((ip, 0))
        return ip, [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class _ThreadedActor:
    """What every actor shares: its component (the coordinator loop, an engine shell, an HTTP
    server; anything with ``stop()``) runs in a thread of the actor process."""

    def _run(self, component, target, name: str) -> None:
        self.component = component
        self.thread = threading.Thread(target=target, name=name, daemon=True)
        self.thread.start()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        """Ask the component to stop (closing its sockets) and wait a little for it."""
        self.component.stop()
        self.thread.join(5)


def _current_size(cluster: str, size: int) -> int:
    """The cluster's rank count for a coordinator that starts with ``size``: Ray restarts an
    actor with the arguments it first had, so one restarted after a resize asks the cluster's
    scaler (``hybridlb.launch.ray_scaling``; none on a first start, or where the cluster cannot
    be resized)."""
    from hybridlb.launch.ray_session import actor_name

    try:
        scaler = ray.get_actor(actor_name(cluster, "scaler"), ray.get_runtime_context().namespace)
    except ValueError:
        return size
    log = logging.getLogger("hybridlb.up")
    try:
        current = ray.get(scaler.size.remote(), timeout=10)
    except Exception as exc:  # a scaler that does not answer: the first size, until its next resize says
        log.warning("the coordinator could not ask the scaler for the cluster's size (%s); it assumes %d ranks",
                    type(exc).__name__, size)
        return size
    if current != size:
        log.info("the coordinator restarts with %d ranks (resized from %d)", current, size)
    return current


@ray.remote
class CoordinatorActor(_ThreadedActor):
    def __init__(self, cluster: str, size: int, lockstep: bool, ip: str, ports: list[int], token: str | None):
        """``ports``: stats in, loads out, waves out, rendezvous (from ``free_ports``)."""
        from hybridlb.coordinator import Coordinator

        stats, loads, waves, rendezvous = (f"tcp://{ip}:{port}" for port in ports)
        size = _current_size(cluster, size)
        self.loop = Coordinator(stats, loads, size, waves if lockstep else None, token)
        self.cluster, self.size = cluster, size
        self.rendezvous = rendezvous if lockstep else None  # rank 0's torch.distributed store listens here
        self._run(self.loop, self.loop.run, "coordinator")

    def addresses(self) -> dict:
        import zmq

        def endpoint(sock) -> str | None:
            return sock.getsockopt_string(zmq.LAST_ENDPOINT) if sock is not None else None

        return {"stats": endpoint(self.loop.stats_in), "loads": endpoint(self.loop.loads_out),
                "waves": endpoint(self.loop.waves_out), "rendezvous": self.rendezvous}

    def snapshot(self) -> dict:
        import msgspec

        return msgspec.to_builtins(self.loop.snapshot)

    def __repr__(self) -> str:
        return f"coordinator cluster={self.cluster} ranks={self.size}"


@ray.remote
class EngineActor(_ThreadedActor):
    def __init__(self, cluster: str, config, dp, node: int, port: int | None, threads: int,
                 host: str | None = None, cores=None):
        """``port``: listen there on ``host`` (default: the node's IP; API servers on other nodes
        use it); else IPC. A restarted engine binds the same address, so its API servers
        reconnect on their own. ``cores``: the node's shared cores, its table named relative to
        the runtime directory (which only this node knows)."""
        import dataclasses

        from hybridlb.engine.core import make_core
        from hybridlb.engine.shell import EngineShell, prepare_process

        prepare_process(config, threads)
        if cores is not None:
            cores = dataclasses.replace(cores, path=os.path.join(runtime_dir(cluster), cores.path))
        self.rank, self.node, self.cluster = dp.rank, node, cluster
        address = (f"tcp://{host or _node_ip()}:{port}" if port
                   else f"ipc://{runtime_dir(cluster)}/engine-{dp.rank}")
        self.shell = EngineShell(make_core(config, dp), address, cores)  # engine.simulate: no model
        self._run(self.shell, self._serve, "engine")

    def _serve(self) -> None:
        try:
            self.shell.serve_forever()
        except Exception as exc:  # e.g. the expert-parallel group broke: let Ray see this actor die
            logging.getLogger(__name__).error("engine %d failed: %s; exiting the actor", self.rank, exc)
            os._exit(1)

    def address(self) -> str:
        return self.shell.address

    def stats(self) -> dict:
        import msgspec

        return {**msgspec.to_builtins(self.shell.latest_stats()), "alive": self.thread.is_alive()}

    def __repr__(self) -> str:
        return f"engine rank={self.rank} node={self.node} cluster={self.cluster}"


@ray.remote
class ApiServerActor(_ThreadedActor):
    def __init__(self, cluster: str, config, spec, host: str, port: int, shared_port: bool):
        import dataclasses

        from hybridlb.api.http_server import listen, make_server, use_shared_metrics

        if shared_port:  # one /metrics for the node's API servers, whichever answers (as in serve)
            metrics_dir = os.path.join(runtime_dir(cluster), f"metrics-node{spec.node}")
            spec = dataclasses.replace(spec, metrics_dir=metrics_dir)
        use_shared_metrics(spec.metrics_dir)
        from hybridlb.api.app import create_app
        from hybridlb.launch.ray_metrics import RayMetricsMirror

        self.cluster, self.spec, self.port = cluster, spec, port
        self.ready_event = threading.Event()
        self.mirror = RayMetricsMirror(cluster, spec.name)
        app = create_app(config, spec, on_ready=self.ready_event.set, observer=self.mirror)
        self.sock = listen(host, port, shared_port)
        self.host = _node_ip() if host in ("0.0.0.0", "::") else host
        server = make_server(app, config, drains=False)
        self._run(server, lambda: server.run(sockets=[self.sock]), "api")

    def wait_ready(self, timeout_s: float) -> bool:
        return self.ready_event.wait(timeout_s)

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"api {self.spec.name} node={self.spec.node} ranks={[r for r, _ in self.spec.engines]}"


@ray.remote(num_cpus=0)
class SupervisorActor:
    """Multi-port: a node's supervisor (``hybridlb.launch.supervisor``), answering probes for its ranks."""

    def __init__(self, cluster: str, node: int, host: str, port: int, children: dict[int, str], interval_s: float,
                 timeout_s: float, failure_threshold: int):
        from hybridlb.launch.supervisor import Supervisor

        self.cluster, self.node = cluster, node
        self.supervisor = Supervisor(host, port, children, interval_s, timeout_s, failure_threshold)
        self.supervisor.start()

    def view(self) -> dict:
        return self.supervisor.view()

    def stop(self) -> None:
        self.supervisor.stop()

    def __repr__(self) -> str:
        return f"supervisor node={self.node} ranks={sorted(self.supervisor.children)} cluster={self.cluster}"
