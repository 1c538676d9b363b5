"""Where one API server stands in the cluster (``ApiServerSpec``), as its launcher hands it over.

Light on purpose: launchers import it and a spawned API server unpickles it before it imports
its metrics library (which reads ``PROMETHEUS_MULTIPROC_DIR`` once, at import;
``hybridlb.api.http_server.use_shared_metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ApiServerSpec:
    """Which engines one API server fronts, and how it fits in the cluster."""

    engines: tuple[tuple[int, str], ...]  # (global rank, address)
    name: str = "api:0"
    node: int = 0
    mode: str = "hybrid"
    coordinator_loads: str | None = None
    policy: str = "cache_aware"
    cluster_token: str | None = None  # keys for TCP sockets (``hybridlb.transport``), resolved by the launcher
    # Several API server processes share the node's port: one /metrics for all of them, kept in
    # files here (whichever process answers a scrape reports the node's totals).
    metrics_dir: str | None = None
    # The launcher's resize socket and its key (``hybridlb.launch.scaling``); None where the
    # node cannot be resized (several nodes, MoE, multi-port).
    scale_control: tuple[str, bytes] | None = None
