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
        help="A NetworkPolicy: the HTTP ports open, the KV-event ports (prompt token ids) to the scheduler's pods "
             "(--kv-events-from), the cluster's own ports to the group's pods only.")] = True,
    kv_events_from: Annotated[str | None, typer.Option(
        help="The label (KEY=VALUE) of the scheduler's pods that read KV events, the only ones the NetworkPolicy "
             "lets reach the KV-event ports (default inferencepool=hybridlb-<ray.name>-epp: how llm-d's "
             "inferencepool chart labels the endpoint picker the InferencePool names).")] = None,
    inference_pool: Annotated[bool, typer.Option(
        help="With --lb multi-port: the InferencePool over every rank port. Leave it out when you install llm-d's "
             "endpoint picker with the inferencepool Helm chart, which makes its own (docs/kubernetes.md).")] = True,
    token_secret: Annotated[bool, typer.Option(
        help="A Secret with the cluster token the pods read: data_parallel.cluster_token, else a random one drawn "
             "now (each render draws a new one). Without it anyone who reaches the rpc port can join.")] = True,
    out: Annotated[Path | None, typer.Option(help="Write here instead of stdout.")] = None,
):
    """A LeaderWorkerSet manifest: one pod per node running `hybridlb serve`, a Service per node
    and one across them, the cluster token's Secret and a NetworkPolicy; with --lb multi-port,
    llm-d's shape (a port per rank, an InferencePool, a PodMonitor). Without --model-pvc /
    --model-host-path the model must be inside the image. What it assumes is printed and heads
    the manifest (docs/kubernetes.md)."""
    from hybridlb.launch.k8s import PodOptions, RenderError, render, whole_cluster
    from hybridlb.launch.k8s_notes import header, notes

    try:
        overrides = {"lb": {"mode": lb.replace("-", "_")}} if lb else {}
        cfg = whole_cluster(build_config(config, overrides, pin_hub=False))  # each pod reads its own cache
        plan, _ = plan_of(cfg)
        options = PodOptions(image=image, model_pvc=model_pvc, model_host_path=model_host_path,
                             memory_gib=memory_gib, shm_gib=shm_gib, network_policy=network_policy,
                             token_secret=token_secret, kv_events_from=kv_events_from,
                             inference_pool=inference_pool)
        said = notes(cfg, plan, options)
        manifest = header(said) + render(cfg, plan, options)
    except RenderError as exc:
        fail(str(exc))
    for note in said:
        typer.secho(f"note: {note}", err=True)
    if out is None:
        typer.echo(manifest, nl=False)
    else:
        out.write_text(manifest)
        typer.echo(f"wrote {out}")
