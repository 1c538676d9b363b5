"""What the CLI modules share: the ``--data-parallel-*`` flag declarations and the error exit."""

from __future__ import annotations

from typing import Annotated

import typer


def fail(message: str) -> None:
    """Print ``error: message`` in red and exit 2."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


DpSize = Annotated[int | None, typer.Option("--data-parallel-size", "-dp", help="Ranks in the whole cluster.")]
DpSizeLocal = Annotated[int | None, typer.Option("--data-parallel-size-local", help="Ranks on this node.")]
DpStartRank = Annotated[int | None, typer.Option("--data-parallel-start-rank", help="This node's first rank.")]
DpRank = Annotated[int | None, typer.Option("--data-parallel-rank", help="External LB: serve only this rank.")]
DpAddress = Annotated[str | None, typer.Option("--data-parallel-address", help="The head node's address.")]
DpRpcPort = Annotated[int | None, typer.Option("--data-parallel-rpc-port", help="The head's handshake port.")]
DpNodeAddress = Annotated[str | None, typer.Option("--data-parallel-node-address",
                                                   help="This node's address for other nodes (internal LB).")]
Headless = Annotated[bool | None, typer.Option("--headless/--no-headless", help="Engines only, no API server.")]
LbMode = Annotated[str | None, typer.Option("--lb-mode", help="hybrid (default), internal or external.")]
ApiServers = Annotated[str | None, typer.Option("--api-servers-per-node", help="N or auto.")]
ClusterToken = Annotated[str | None, typer.Option("--cluster-token", envvar="HYBRIDLB_CLUSTER_TOKEN",
                                                  help="Shared secret for joining the cluster.")]
