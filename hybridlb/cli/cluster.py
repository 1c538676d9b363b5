"""``hybridlb up / status / scale / down``: a cluster placed on Ray (``hybridlb.launch.ray_driver``, ``ray_admin``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from hybridlb.cli.config_flags import options, overrides
from hybridlb.cli.options import build_config, fail, stopped_before_start, with_options
from hybridlb.cli.problems import Problems
from hybridlb.cli.start_checks import check_start


@with_options(options("up"), into="flags")
def up(
    config: Annotated[Path, typer.Argument(help="YAML config describing the whole cluster.")],
    detach: Annotated[bool, typer.Option(help="Leave the cluster running after this command exits.")] = False,
    flags: dict[str, Any] | None = None,
):
    """Place the cluster on Ray: per node an API server and its engines, one coordinator."""
    with stopped_before_start():
        problems = Problems()
        cfg = build_config(config, overrides(flags, problems), problems)
        plan, _ = check_start(cfg, problems, cluster=True) if cfg is not None else (None, None)
        problems.raise_any()  # every problem of the config, as `serve` lists them
        from hybridlb.launch.ray_driver import up as ray_up  # Ray is imported once the checks passed
        from hybridlb.launch.ray_session import UpError

        try:
            code = ray_up(cfg, plan, detach)
        except UpError as exc:
            fail(str(exc))
    raise typer.Exit(code)


def status(
    name: Annotated[str, typer.Argument(help="Cluster name given to `hybridlb up`.")] = "default",
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: auto).")] = None,
    namespace: Annotated[str, typer.Option()] = "hybridlb",
    url: Annotated[str | None, typer.Option(
        help="Ask a running API server instead (any launcher): http://HOST:PORT.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="HYBRIDLB_API_KEY", help="With --url: its API key.")] = None,
):
    """Every actor of a cluster started with `hybridlb up`: state, node and load (or, with
    --url, what one API server sees: its engines, the coordinator, lost ranks)."""
    if url is not None:
        from hybridlb.cli.server_status import StatusError, server_status

        try:
            text, healthy = server_status(url.rstrip("/"), api_key)
        except StatusError as exc:
            fail(str(exc))
        typer.echo(text)
        raise typer.Exit(0 if healthy else 1)
    from hybridlb.launch.ray_admin import status as ray_status
    from hybridlb.launch.ray_session import UpError

    try:
        rows = ray_status(name, address, namespace)
    except UpError as exc:
        fail(str(exc))
    if not rows:
        fail(f"no cluster named {name!r} in namespace {namespace!r}")
    typer.echo(f"{'actor':<36}{'state':<12}{'node':<14}load")
    for row in rows:
        typer.echo(f"{row['name']:<36}{row['state']:<12}{row['node']:<14}{row['load']}")


def down(
    name: Annotated[str, typer.Argument(help="Cluster name given to `hybridlb up`.")] = "default",
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: auto).")] = None,
    namespace: Annotated[str, typer.Option()] = "hybridlb",
):
    """Stop every actor of a cluster and release its placement group."""
    from hybridlb.launch.ray_admin import down as ray_down
    from hybridlb.launch.ray_session import UpError

    try:
        missing = ray_down(name, address, namespace)
    except UpError as exc:
        fail(str(exc))
    if missing:
        fail(f"no cluster named {name!r} in namespace {namespace!r}")


def scale(
    name: Annotated[str, typer.Argument(help="Cluster name given to `hybridlb up`.")] = "default",
    data_parallel_size: Annotated[int, typer.Option("--data-parallel-size", "-dp",
                                                    help="The cluster's new number of ranks.")] = ...,
    drain_timeout: Annotated[float, typer.Option(
        help="Shrinking: seconds a leaving rank's requests may run before they move to the ranks that stay.")] = 120.0,
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: auto).")] = None,
    namespace: Annotated[str, typer.Option()] = "hybridlb",
):
    """Resize a running one-node cluster (a dense model): new ranks start and warm up before they
    take traffic; leaving ranks drain, then what still runs moves on. Same as POST /scale_elastic_ep."""
    from hybridlb.launch.ray_scaling import scale as ray_scale
    from hybridlb.launch.ray_session import UpError

    try:
        print(ray_scale(name, data_parallel_size, drain_timeout, address, namespace))
    except UpError as exc:
        fail(str(exc))
