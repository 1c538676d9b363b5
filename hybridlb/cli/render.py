"""``hybridlb render k8s``: the cluster as a LeaderWorkerSet manifest (hybridlb.launch.k8s)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridlb.cli.options import build_config, fail, plan_of

render_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Render the cluster for other platforms.")


@render_app.command("k8s")
def render_k8s(
    config: Annotated[Path, typer.Argument(help="YAML config: the whole cluster (data_parallel.nodes), or one "
                                                 "node of it (size and size_local), repeated.")],
    image: Annotated[str | None, typer.Option(
        help="Container image with hybridlb (default hybridlb:cpu or hybridlb:cuda, as the Dockerfile builds "
             "them).")] = None,
    model_pvc: Annotated[str | None, typer.Option(
        help="PersistentVolumeClaim holding the model, mounted where engine.model points.")] = None,
    model_host_path: Annotated[str | None, typer.Option(
        help="Directory on every node holding the model, mounted where engine.model points.")] = None,
    memory_gib: Annotated[float | None, typer.Option(
        help="Memory per pod (default: estimated from the model when it is readable here).")] = None,
    shm_gib: Annotated[float, typer.Option(help="Size of each pod's memory-backed /dev/shm.")] = 1.0,
    lb: Annotated[str | None, typer.Option(
        help="The pods' load balancing (default: the config's lb.mode): hybrid, or multi-port, llm-d's current "
             "shape (a port per rank, probes on a supervisor port, an InferencePool over every rank port and a "
             "PodMonitor).")] = None,
    network_policy: Annotated[bool, typer.Option(
        help="Also a NetworkPolicy: the HTTP ports open, the cluster's own ports to the group's pods only.")] = False,
    out: Annotated[Path | None, typer.Option(help="Write here instead of stdout.")] = None,
):
    """A LeaderWorkerSet manifest: one pod per node running `hybridlb serve`, a Service per node
    and one across them. Without --model-pvc / --model-host-path the model must be inside the image."""
    from hybridlb.launch.k8s import PodOptions, RenderError, memory_note, render, whole_cluster

    try:
        overrides = {"lb": {"mode": lb.replace("-", "_")}} if lb else {}
        cfg = whole_cluster(build_config(config, None, overrides))
        plan, _ = plan_of(cfg)
        options = PodOptions(image, model_pvc, model_host_path, memory_gib, shm_gib, network_policy)
        manifest = render(cfg, plan, options)
    except RenderError as exc:
        fail(str(exc))
    if (note := memory_note(cfg, options)) is not None:
        typer.secho(f"note: {note}", err=True)
    if out is None:
        typer.echo(manifest, nl=False)
    else:
        out.write_text(manifest)
        typer.echo(f"wrote {out}")
