"""`hybridlb up` on a real multi-node Ray cluster (tests/cluster/netns): `ray start --head` on one
host, `ray start --address` on two more, then `hybridlb up --address` from the head places one
API server and its engines on every host (pinned only by `ray_resource`, no addresses in the
config) and `hybridlb down` removes them.

Each host gets a Ray directory of its own (`/tmp/ray` bound per host, as on separate
machines). Ray's daemons are stopped through the `ray start --block` processes the test owns
(never `ray stop`, which kills every Ray process on the machine by name).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.netns.hosts import Host, HostNetwork
from tests.cluster.netns.test_serve_hosts import expected, texts

pytestmark = pytest.mark.slow
RAY_DIR = Path("/tmp/ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
API_PORT = 8900


class RayHosts:
    """A Ray cluster with one node per host of ``network``."""

    def __init__(self, network: HostNetwork, root: Path):
        self.network, self.root = network, root
        self.head = network.hosts[0]
        self.address = f"{self.head.address}:6379"
        self.nodes: list[subprocess.Popen] = []
        RAY_DIR.mkdir(exist_ok=True)  # the mount point; each host binds its own directory over it

    def command(self, host: Host, argv: list[str]) -> list[str]:
        own = self.root / f"ray-{host.name}"
        own.mkdir(exist_ok=True)
        return self.network.command(host, argv, {str(RAY_DIR): str(own)})

    def start(self) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        for host in self.network.hosts:
            role = (["--head", "--port=6379", "--include-dashboard=true"] if host is self.head
                    else [f"--address={self.address}"])
            argv = [ray, "start", "--block", f"--node-ip-address={host.address}", "--num-cpus=2",
                    f'--resources={{"{host.name}": 1}}', *role]
            log = open(self.root / f"ray-{host.name}.log", "w")  # noqa: SIM115 - the child keeps it
            self.nodes.append(subprocess.Popen(self.command(host, argv), env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            if host is self.head:
                time.sleep(3)  # the GCS first
        deadline = time.monotonic() + 120
        while self.alive_nodes() < len(self.network.hosts):
            assert time.monotonic() < deadline, "the Ray nodes did not all join"
            time.sleep(1)

    def alive_nodes(self) -> int:
        probe = ("import ray; ray.init(address='auto', log_to_driver=False); "
                 "print(sum(n['Alive'] for n in ray.nodes()))")
        run = subprocess.run(self.command(self.head, [sys.executable, "-c", probe]), env={**ENV, "RAY_ADDRESS":
                             self.address}, capture_output=True, text=True, timeout=60)
        return int(run.stdout.split()[-1]) if run.returncode == 0 and run.stdout.split() else 0

    def hybridlb(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "hybridlb", *args, "--address", self.address]
        return subprocess.run(self.command(self.head, argv), env=ENV, capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        for node in reversed(self.nodes):  # ray start --block stops its daemons on SIGTERM
            node.send_signal(signal.SIGTERM)
        for node in reversed(self.nodes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(40)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)  # whatever is left of its process group


@pytest.fixture
def ray_hosts(network, tmp_path):
    cluster = RayHosts(network, tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_up_places_an_api_server_and_its_engines_on_every_ray_node(ray_hosts, network, tiny_qwen3, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "engine": {"model": tiny_qwen3, "dtype": "float32", "max_model_len": 512, "kv_cache_gib": 0.05},
        "api": {"host": "0.0.0.0", "port": API_PORT},  # every node the same port: they are hosts of their own
        "data_parallel": {"size": 3, "nodes": [{"size_local": 1, "ray_resource": h.name} for h in network.hosts]},
        "ray": {"name": "netns", "cpus_per_engine": 1, "cpus_per_api_server": 0.5},
    }))
    started = time.monotonic()
    up = ray_hosts.hybridlb("up", str(config), "--detach")
    assert up.returncode == 0, up.stdout + up.stderr
    print(f"\nRay, 3 hosts: up --detach returned in {time.monotonic() - started:.1f} s")
    try:
        for index, host in enumerate(network.hosts):  # each node's API server on that host, its own rank
            url = f"http://{host.address}:{API_PORT}"
            assert f"{url}/v1" in up.stdout, up.stdout
            assert httpx.get(f"{url}/ranks", timeout=10).json()["ranks"] == [index]
            assert texts(url, tiny_qwen3) == expected(tiny_qwen3)
        status = ray_hosts.hybridlb("status", "netns")
        assert status.returncode == 0 and status.stdout.count("ALIVE") == 1 + 3 + 3, status.stdout
    finally:
        down = ray_hosts.hybridlb("down", "netns")
    assert down.returncode == 0, down.stdout + down.stderr
    for host in network.hosts:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{host.address}:{API_PORT}/health", timeout=3)
