"""One network of three hosts (namespaces) for every test under tests/cluster/netns."""

from __future__ import annotations

import pytest

from tests.cluster.netns.hosts import HostNetwork, HostNetworkUnavailable


@pytest.fixture(scope="session")
def network():
    try:
        hosts = HostNetwork(3)
    except HostNetworkUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    yield hosts
    hosts.close()
