"""The ``hybridlb`` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from hybridlb import vllm_args
from hybridlb.bench.cli import bench_app
from hybridlb.cli_common import (
    VLLM_FLAGS,
    ApiServers,
    ClusterToken,
    DpAddress,
    DpNodeAddress,
    DpRank,
    DpRpcPort,
    DpSize,
    DpSizeLocal,
    DpStartRank,
    Headless,
    LbMode,
    build_config,
    json_flag,
    parallel_overrides,
    plan_of,
    served_names,
    simulate_flags,
)
from hybridlb.cli_common import fail as _fail
from hybridlb.config import Config, EngineConfig
from hybridlb.launch.k8s_cli import render_app

MODEL_HELP = "Checkpoint: a Hugging Face directory, a .gguf file, or package:DIST/PATH."

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)
app.add_typer(bench_app, name="bench")
app.add_typer(render_app, name="render")


def ensure_checkpoint(engine: EngineConfig) -> None:
    """Write the config's random checkpoint on first use, if it asks for one."""
    if engine.make_if_missing is None or Path(engine.model).exists():
        return
    from hybridlb.model.make_model import make_model

    spec = engine.make_if_missing
    typer.echo(f"making a {spec.size} random-weight {spec.arch} checkpoint at {engine.model}", err=True)
    make_model(spec.arch, spec.size, engine.model, seed=spec.seed)


def check_model_options(cfg: Config) -> None:
    """Fail before anything starts on a model, chat template or generation config that cannot load."""
    from hybridlb.model.chat_template import read_template_argument
    from hybridlb.model.checkpoint import CheckpointError, resolve
    from hybridlb.model.generation_config import sampling_defaults

    try:
        resolve(cfg.engine.model)
        if cfg.api.chat_template:
            read_template_argument(cfg.api.chat_template)
        sampling_defaults(cfg.engine.model, cfg.api.generation_config)
    except CheckpointError as exc:
        _fail(str(exc))


@app.command("make-model")
def make_model_command(
    out: Annotated[Path, typer.Option(help="Directory to write the checkpoint into.")],
    arch: Annotated[str, typer.Option(help="llama, qwen2, qwen3, qwen3_moe or mixtral.")] = "qwen3",
    size: Annotated[str, typer.Option(help="tiny (tests, seconds on CPU) or small (benchmarks).")] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    max_shard_mb: Annotated[float, typer.Option(help="Split weights into shards of this size (0: one file).")] = 0,
):
    """Write a random-weight Hugging Face checkpoint with a real tokenizer, fully offline."""
    from hybridlb.model.make_model import make_model

    try:
        path = make_model(arch, size, out, seed=seed, max_shard_mb=max_shard_mb or None)
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(f"wrote {arch} ({size}) to {path}")


@app.command()
def generate(
    prompt: Annotated[list[str], typer.Option(help="Prompt text; repeat for a batch.")],
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    config: Annotated[Path | None, typer.Option(help="YAML config; flags override it.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 32,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables it.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Per-request sampling seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string; repeatable.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep going past end-of-sequence.")] = False,
    max_model_len: Annotated[int | None, typer.Option()] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda.")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto, float32, bfloat16 or float16.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per prompt.")] = False,
):
    """Generate offline, in this process, for one or more prompts."""
    from hybridlb.llm import LLM
    from hybridlb.model.spec import CheckpointError
    from hybridlb.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=stop or [], ignore_eos=ignore_eos)
    if problems := params.problems():
        _fail("; ".join(message for _, message in problems))
    cfg = build_config(config, model, {"engine": dict(max_model_len=max_model_len, device=device, dtype=dtype)})
    try:
        ensure_checkpoint(cfg.engine)
        llm = LLM(**cfg.engine.model_dump(exclude={"make_if_missing"}))
        results = llm.generate(prompt, params)
    except (CheckpointError, ValueError, RuntimeError) as exc:
        _fail(str(exc))
    for text, result in zip(prompt, results, strict=True):
        if as_json:
            typer.echo(json.dumps({"prompt": text, "text": result.text, "token_ids": result.token_ids,
                                   "finish_reason": result.finish_reason}, ensure_ascii=False))
        else:
            typer.echo(f"{text}\x1b[1m{result.text}\x1b[0m" if sys.stdout.isatty() else text + result.text)


@app.command()
def serve(
    model: Annotated[str | None, typer.Option(help=MODEL_HELP, rich_help_panel=VLLM_FLAGS)] = None,
    config: Annotated[Path | None, typer.Option(help="YAML config; flags override it.")] = None,
    host: Annotated[str | None, typer.Option(help="HTTP interface (default 127.0.0.1).", rich_help_panel=VLLM_FLAGS)] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default 8000).", rich_help_panel=VLLM_FLAGS)] = None,
    served_model_name: Annotated[list[str] | None, typer.Option(
        help="Name clients use (default: --model as given); repeat it, or list several after it as vLLM does, "
             "to answer to several.", rich_help_panel=VLLM_FLAGS)] = None,
    api_key: Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on /v1.", rich_help_panel=VLLM_FLAGS)] = None,
    max_concurrent_requests: Annotated[int | None, typer.Option(
        help="Sequences (prompts x n) each API server works on at once; more get 429 (default 4096).")] = None,
    request_timeout: Annotated[float | None, typer.Option(
        help="Fail a request (504) its engine has said nothing about for this many seconds (default 300, "
             "0: never).")] = None,
    max_queued_requests: Annotated[int | None, typer.Option(
        help="Requests one engine keeps waiting for a batch slot; beyond it, 429 (default 1024).")] = None,
    chat_template: Annotated[str | None, typer.Option(
        help="Chat template file (or text) replacing the model's own.", rich_help_panel=VLLM_FLAGS)] = None,
    generation_config: Annotated[str | None, typer.Option(
        help="Sampling defaults: auto (the model's generation_config.json), vllm (none) or a directory.", rich_help_panel=VLLM_FLAGS)] = None,
    max_model_len: Annotated[int | None, typer.Option(rich_help_panel=VLLM_FLAGS)] = None,
    max_num_seqs: Annotated[int | None, typer.Option(rich_help_panel=VLLM_FLAGS)] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(rich_help_panel=VLLM_FLAGS)] = None,
    kv_cache_gib: Annotated[float | None, typer.Option()] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        help="CUDA: size the KV cache to fill this fraction of GPU memory (instead of --kv-cache-gib).", rich_help_panel=VLLM_FLAGS)] = None,
    block_size: Annotated[int | None, typer.Option(rich_help_panel=VLLM_FLAGS)] = None,
    enable_prefix_caching: Annotated[bool | None, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse cached prompt prefixes (default on).", rich_help_panel=VLLM_FLAGS)] = None,
    kv_events_config: Annotated[str | None, typer.Option(
        help="KV-cache events as JSON, vLLM's keys, e.g. '{\"enable_kv_cache_events\": true}'.", rich_help_panel=VLLM_FLAGS)] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda.")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto, float32, bfloat16 or float16.", rich_help_panel=VLLM_FLAGS)] = None,
    seed: Annotated[int | None, typer.Option(rich_help_panel=VLLM_FLAGS)] = None,
    torch_threads: Annotated[int | None, typer.Option(help="Threads per engine (0: split the cores).")] = None,
    share_cores: Annotated[bool | None, typer.Option(
        "--share-cores/--no-share-cores",
        help="An engine stepping while the node's others idle uses their cores too (default on).")] = None,
    enable_expert_parallel: Annotated[bool | None, typer.Option(
        "--enable-expert-parallel/--no-enable-expert-parallel", help="MoE: shard experts over the DP ranks.", rich_help_panel=VLLM_FLAGS)] = None,
    async_dp_coordination: Annotated[bool | None, typer.Option(
        "--async-dp-coordination/--no-async-dp-coordination",
        help="Expert parallel: overlap the per-step metadata exchange (default on).")] = None,
    dp_timeout: Annotated[float | None, typer.Option(
        help="Expert parallel: seconds before a collective a rank never joins fails the group (default 120).")] = None,
    lb_policy: Annotated[str | None, typer.Option(help="cache_aware (default), least_loaded or round_robin.")] = None,
    simulate_step_ms: Annotated[float | None, typer.Option(
        help="SIMULATED engines for control-plane benchmarks: no model, each step sleeps this long.")] = None,
    simulate_per_token_ms: Annotated[float | None, typer.Option(
        help="With --simulate-step-ms: extra step time per token computed.")] = None,
    data_parallel_size: DpSize = None,
    data_parallel_size_local: DpSizeLocal = None,
    data_parallel_start_rank: DpStartRank = None,
    data_parallel_rank: DpRank = None,
    data_parallel_address: DpAddress = None,
    data_parallel_rpc_port: DpRpcPort = None,
    data_parallel_node_address: DpNodeAddress = None,
    headless: Headless = None,
    lb_mode: LbMode = None,
    api_servers_per_node: ApiServers = None,
    cluster_token: ClusterToken = None,
    restart_policy: Annotated[str | None, typer.Option(
        help="none (default): report a dead part and serve on; restart: bring it back in place.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check the command and print the cluster plan and this node's part; start nothing.")] = False,
):
    """Serve the OpenAI API from this node: its engines and API servers, no Ray.

    vLLM's spelling works too, e.g. `hybridlb serve MODEL -dp 4 -dpl 2 --data-parallel-hybrid-lb --max_model_len 32k --dtype half`: the short forms -dp -dpl -dpr -dpn -dpa -dpp -dph -dpe -ep, underscores, --data-parallel-hybrid-lb / --data-parallel-external-lb for --lb-mode, --api-server-count, k/K length suffixes, several --served-model-name names, VLLM_API_KEY. A vLLM flag hybridlb does not implement is an error saying what to do instead.
    """
    from hybridlb.launch.serve import serve as serve_node

    parallel = parallel_overrides(data_parallel_size, data_parallel_size_local, data_parallel_start_rank,
                                   data_parallel_rank, data_parallel_address, data_parallel_rpc_port,
                                   data_parallel_node_address, headless, lb_mode, api_servers_per_node,
                                   cluster_token, lb_policy)
    parallel["data_parallel"]["restart_policy"] = restart_policy
    cfg = build_config(config, model, {
        "engine": dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs, device=device, dtype=dtype,
                       max_queued_requests=max_queued_requests,
                       max_num_batched_tokens=max_num_batched_tokens, kv_cache_gib=kv_cache_gib,
                       gpu_memory_utilization=gpu_memory_utilization,
                       block_size=block_size, seed=seed, torch_threads=torch_threads,
                       share_cores=share_cores, prefix_caching=enable_prefix_caching, kv_events=json_flag("--kv-events-config", kv_events_config),
                       expert_parallel=enable_expert_parallel, async_dp_coordination=async_dp_coordination,
                       dp_timeout_s=dp_timeout, simulate=simulate_flags(simulate_step_ms, simulate_per_token_ms)),
        "api": dict(host=host, port=port, served_model_name=served_names(served_model_name), api_key=api_key,
                    max_concurrent_requests=max_concurrent_requests, request_timeout_s=request_timeout,
                    chat_template=chat_template,
                    generation_config=generation_config),
        **parallel,
    })

    ensure_checkpoint(cfg.engine)
    check_model_options(cfg)
    if cfg.engine.simulate is not None:
        typer.secho(f"warning: SIMULATED engines ({cfg.engine.simulate.step_ms:g} ms per step, no model "
                    "loaded): for control-plane benchmarks only", fg=typer.colors.YELLOW, err=True)
    plan, node = plan_of(cfg)
    if dry_run:
        from hybridlb.plan import format_plan

        typer.echo(f"{format_plan(plan)}\nthis node: {node.summary()}; model {cfg.served_model_names}, "
                   f"dtype {cfg.engine.dtype}, max_model_len {cfg.engine.max_model_len}")
        raise typer.Exit(0)
    raise typer.Exit(serve_node(cfg, plan, node))


@app.command()
def plan(
    model: Annotated[str | None, typer.Option(help=MODEL_HELP + " Read for dense vs MoE.")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML config; flags override it.")] = None,
    host: Annotated[str | None, typer.Option(help="HTTP interface.")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port.")] = None,
    data_parallel_size: DpSize = None,
    data_parallel_size_local: DpSizeLocal = None,
    data_parallel_start_rank: DpStartRank = None,
    data_parallel_rank: DpRank = None,
    data_parallel_address: DpAddress = None,
    data_parallel_rpc_port: DpRpcPort = None,
    data_parallel_node_address: DpNodeAddress = None,
    headless: Headless = None,
    lb_mode: LbMode = None,
    api_servers_per_node: ApiServers = None,
    enable_expert_parallel: Annotated[bool | None, typer.Option(
        "--enable-expert-parallel/--no-enable-expert-parallel", help="MoE: shard experts over the DP ranks.")] = None,
):
    """Print the rank map (nodes → ranks → API servers → ports), or every problem with its fix."""
    from hybridlb.plan import format_plan

    cfg = build_config(config, model or ("(none)" if config is None else None), {
        "engine": dict(expert_parallel=enable_expert_parallel),
        "api": dict(host=host, port=port),
        **parallel_overrides(data_parallel_size, data_parallel_size_local, data_parallel_start_rank,
                              data_parallel_rank, data_parallel_address, data_parallel_rpc_port,
                              data_parallel_node_address, headless, lb_mode, api_servers_per_node, None),
    })
    cluster, _ = plan_of(cfg)
    typer.echo(format_plan(cluster))


def _whole_cluster(config: Path, overrides: dict) -> tuple[Config, object]:
    cfg = build_config(config, None, overrides)
    ensure_checkpoint(cfg.engine)
    plan, _ = plan_of(cfg)
    return cfg, plan


@app.command()
def up(
    config: Annotated[Path, typer.Argument(help="YAML config describing the whole cluster.")],
    address: Annotated[str | None, typer.Option(help="Ray cluster: 'auto' or HOST:PORT (default: start one).")] = None,
    detach: Annotated[bool, typer.Option(help="Leave the cluster running after this command exits.")] = False,
    name: Annotated[str | None, typer.Option(help="Cluster name (default: ray.name, 'default').")] = None,
):
    """Place the cluster on Ray: per node an API server and its engines, one coordinator."""
    from hybridlb.launch.ray_up import UpError
    from hybridlb.launch.ray_up import up as ray_up

    cfg, plan = _whole_cluster(config, {"ray": dict(address=address, name=name)})
    check_model_options(cfg)
    try:
        code = ray_up(cfg, plan, detach)
    except UpError as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@app.command()
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
        from hybridlb.api.status import StatusError, describe

        try:
            text, healthy = describe(url.rstrip("/"), api_key)
        except StatusError as exc:
            _fail(str(exc))
        typer.echo(text)
        raise typer.Exit(0 if healthy else 1)
    from hybridlb.launch.ray_up import status as ray_status

    rows = ray_status(name, address, namespace)
    if not rows:
        _fail(f"no cluster named {name!r} in namespace {namespace!r}")
    typer.echo(f"{'actor':<36}{'state':<12}{'node':<14}load")
    for row in rows:
        typer.echo(f"{row['name']:<36}{row['state']:<12}{row['node']:<14}{row['load']}")


@app.command()
def down(
    name: Annotated[str, typer.Argument(help="Cluster name given to `hybridlb up`.")] = "default",
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: auto).")] = None,
    namespace: Annotated[str, typer.Option()] = "hybridlb",
):
    """Stop every actor of a cluster and release its placement group."""
    from hybridlb.launch.ray_up import down as ray_down

    if ray_down(name, address, namespace):
        _fail(f"no cluster named {name!r} in namespace {namespace!r}")


def main() -> None:
    """The ``hybridlb`` command: ``serve`` also takes ``vllm serve``'s spelling (see vllm_args)."""
    args = sys.argv[1:]
    if args[:1] == ["serve"] and not {"-h", "--help"} & set(args):
        try:
            translated, notes = vllm_args.translate(args[1:])
        except vllm_args.FlagError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise SystemExit(2) from None
        for note in notes:
            typer.secho(f"note: {note}", err=True)
        sys.argv[1:] = ["serve", *translated]
    app()


if __name__ == "__main__":
    main()
