"""One Ray cluster of three nodes on this machine, shared by the Ray tests."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

NODE_RESOURCES = ("node_a", "node_b", "node_c")


@pytest.fixture(scope="session")
def ray_cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the state API talks to the dashboard
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 6, "resources": {NODE_RESOURCES[0]: 1}})
    for resource in NODE_RESOURCES[1:]:
        cluster.add_node(num_cpus=6, resources={resource: 1})
    ray.init(address=cluster.address, namespace="hybridlb", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
