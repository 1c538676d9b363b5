"""``hybridlb serve`` (this node's process tree, no Ray) and ``hybridlb plan`` (the rank map)."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from hybridlb.cli.config_flags import options, overrides
from hybridlb.cli.options import CONFIG, build_config, fail, plan_of, stopped_before_start, with_options
from hybridlb.cli.problems import Problems, given_on_the_command_line
from hybridlb.cli.start_checks import check_start

SERVE_HELP = (
    "Serve the OpenAI API from this node: its engines and API servers, no Ray.\n\n"
    "vLLM's spelling works too, e.g. `hybridlb serve MODEL -dp 4 -dpl 2 --data-parallel-hybrid-lb --max_model_len 32k "
    "--dtype half`: the short forms -dp -dpl -dpr -dpn -dpa -dpp -dph -dpe -ep, underscores, "
    "--data-parallel-hybrid-lb / --data-parallel-external-lb for --lb-mode, --api-server-count, k/K length suffixes, "
    "several --served-model-name names, VLLM_API_KEY. A vLLM flag that changes nothing here is accepted with a note; "
    "one whose meaning hybridlb would change is an error saying what to do instead; with --engine-backend vllm, vLLM's "
    "engine flags that hybridlb's engine does not take (-tp 2, --kv-cache-dtype fp8, --quantization awq, a flag not "
    "listed here) go to vLLM's engine as written (--vllm-args). Every problem of a command line "
    "(flags, config, model options, topology, ports in use) is listed at once, by --dry-run too."
)


@with_options(options("serve"), into="flags")
def serve(
    context: typer.Context,
    config: CONFIG = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check the command and print the cluster plan and this node's part; start nothing.")] = False,
    flags: dict[str, Any] | None = None,
):
    """Serve the OpenAI API from this node: its engines and API servers, no Ray (see SERVE_HELP)."""
    with stopped_before_start():
        problems = given_on_the_command_line(context)  # the vLLM flags hybridlb refused, listed with the rest
        cfg = build_config(config, overrides(flags, problems), problems)
        plan = node = None
        if cfg is not None:
            cfg = _in_a_pod(cfg)
            plan, node = check_start(cfg, problems, dry_run=dry_run)  # the dry run's checks are the start's
        problems.raise_any()
        if dry_run:
            from hybridlb.plan import format_plan

            typer.echo(f"{format_plan(plan)}\nthis node: {node.summary()}; {_engine_summary(cfg)}")
            raise typer.Exit(0)
        sockets = _listening(node)
        from hybridlb.launch.serve_node import serve as serve_node  # imported once the checks passed: ~1 s

        code = serve_node(cfg, plan, node, sockets)
    raise typer.Exit(code)


@with_options(options("plan"), into="flags")
def plan(config: CONFIG = None, flags: dict[str, Any] | None = None):
    """Print the rank map (nodes → ranks → API servers → ports), or every problem with its fix."""
    from hybridlb.plan import format_plan

    problems = Problems()
    sections = overrides(flags, problems)
    if config is None:  # the model is read for dense vs MoE if it is given; the plan needs none
        sections.setdefault("engine", {}).setdefault("model", "(none)")
    cfg = build_config(config, sections, problems)
    cluster, _ = plan_of(cfg, problems) if cfg is not None else (None, None)
    problems.raise_any()
    typer.echo(format_plan(cluster))


def _listening(node) -> dict:
    """This node's API server sockets, listening before any engine loads (one line if a port was
    taken since the check: ``launch.ports``)."""
    from hybridlb.launch.ports import PortTaken, bind_api_servers

    try:
        return bind_api_servers(node)
    except PortTaken as exc:
        fail(str(exc))


def _engine_summary(cfg) -> str:
    """The model settings this node's engines will run with, resolved as they will resolve them."""
    from hybridlb.checkpoint.spec import load_spec
    from hybridlb.engine.dtypes import engine_dtype
    from hybridlb.engine.weights import is_gguf, weights_summary

    engine = cfg.engine
    dtype = engine_dtype(engine)
    max_len = load_spec(engine.model).model_len(engine.max_model_len)
    weights = weights_summary(engine, is_gguf(engine))
    return (f"model {cfg.served_model_names}, dtype {dtype}"
            + (" (auto)" if engine.dtype == "auto" else "")
            + (f", {weights}" if weights else "")
            + (f", speculative {engine.speculative.method} x{engine.speculative.num_speculative_tokens}"
               if engine.speculative else "")
            + (f", LoRA ({len(engine.lora.modules)} adapters, {engine.lora.max_loras} per engine)"
               if engine.lora else "")
            + f", max_model_len {max_len}" + ("" if engine.max_model_len else " (the model's)")
            + (", eager (no decode program)" if engine.enforce_eager else ""))


def _in_a_pod(cfg):
    """In a Kubernetes pod, with no --host or api.host: listen on every interface, as vLLM does, so the
    kubelet's probes and the gateway reach it (elsewhere hybridlb keeps to loopback by default)."""
    if "host" in cfg.api.model_fields_set or "KUBERNETES_SERVICE_HOST" not in os.environ:
        return cfg
    typer.secho("note: in a Kubernetes pod with no --host: listening on 0.0.0.0, as vLLM does", err=True)
    return cfg.model_copy(update={"api": cfg.api.model_copy(update={"host": "0.0.0.0"})})
