"""Launchers: start a node's components, wait until they are ready, tear them down —
``node`` (``hybridlb serve``: one node's processes, the rpc-port ``handshake``), the Ray
driver and actors (``hybridlb up``), and ``k8s`` (a LeaderWorkerSet manifest)."""
