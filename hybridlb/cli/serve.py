"""``hybridlb serve`` (this node's process tree, no Ray) and ``hybridlb plan`` (the rank map)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from hybridlb.cli.options import (
    EXPERT_PARALLEL,
    MODEL_HELP,
    PARALLEL,
    build_config,
    fail,
    json_flag,
    lora_flags,
    parallel_overrides,
    plan_of,
    served_names,
    stopped_before_start,
    vllm_option,
    with_options,
)
from hybridlb.cli.problems import Problems, given_on_the_command_line
from hybridlb.cli.start_checks import check_start
from hybridlb.config import LoRAConfig

SERVE_HELP = (
    "Serve the OpenAI API from this node: its engines and API servers, no Ray.\n\n"
    "vLLM's spelling works too, e.g. `hybridlb serve MODEL -dp 4 -dpl 2 --data-parallel-hybrid-lb --max_model_len 32k "
    "--dtype half`: the short forms -dp -dpl -dpr -dpn -dpa -dpp -dph -dpe -ep, underscores, "
    "--data-parallel-hybrid-lb / --data-parallel-external-lb for --lb-mode, --api-server-count, k/K length suffixes, "
    "several --served-model-name names, VLLM_API_KEY. A vLLM flag that changes nothing here is accepted with a note; "
    "one whose meaning hybridlb would change is an error saying what to do instead. Every problem of a command line "
    "(flags, config, model options, topology, ports in use) is listed at once, by --dry-run too."
)


@with_options(PARALLEL, into="parallel")
def serve(
    context: typer.Context,
    model: Annotated[str | None, vllm_option(help=MODEL_HELP)] = None,
    revision: Annotated[str | None, vllm_option(
        help="Hub model: the branch, tag or commit to take from the local Hugging Face cache (default main).")] = None,
    tokenizer: Annotated[str | None, vllm_option(
        help="Accepted when it names the model's own checkpoint (the tokenizer is always the model's).")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML config; flags override it.")] = None,
    host: Annotated[str | None, vllm_option(help="HTTP interface (default 127.0.0.1).")] = None,
    port: Annotated[int | None, vllm_option(help="HTTP port (default 8000).")] = None,
    served_model_name: Annotated[list[str] | None, vllm_option(
        help="Name clients use (default: --model as given); repeat it, or list several after it as vLLM does, "
             "to answer to several.")] = None,
    api_key: Annotated[str | None, vllm_option(help="Require 'Authorization: Bearer KEY' on /v1.")] = None,
    max_concurrent_requests: Annotated[int | None, typer.Option(
        help="Sequences (prompts x n) each API server works on at once; more get 429 (default 4096).")] = None,
    request_timeout: Annotated[float | None, typer.Option(
        help="Fail a request (504) its engine has said nothing about for this many seconds (default 300, "
             "0: never).")] = None,
    max_queued_requests: Annotated[int | None, typer.Option(
        help="Requests one engine keeps waiting for a batch slot; beyond it, 429 (default 1024).")] = None,
    chat_template: Annotated[str | None, vllm_option(
        help="Chat template file (or text) replacing the model's own.")] = None,
    generation_config: Annotated[str | None, vllm_option(
        help="Sampling defaults: auto (the model's generation_config.json), vllm (none) or a directory.")] = None,
    max_model_len: Annotated[int | None, vllm_option(
        help="Longest prompt plus output, in tokens: 4096, 32k (32,000), 32K (32,768) (default: the model's).")] = None,
    max_num_seqs: Annotated[int | None, vllm_option(help="Most requests in one batch per engine (default 64).")] = None,
    max_num_batched_tokens: Annotated[int | None, vllm_option(
        help="Token budget of one step; longer prompts prefill in chunks (default 1024 on CPU, 512 on AMX in "
             "bfloat16, 8192 on CUDA).")] = None,
    kv_cache_gib: Annotated[float | None, typer.Option(
        help="Memory for each engine's KV cache, in GiB (default 0.5; on CUDA, --gpu-memory-utilization sizes it "
             "instead when given).")] = None,
    gpu_memory_utilization: Annotated[float | None, vllm_option(
        help="CUDA: size the KV cache to fill this fraction of GPU memory (instead of --kv-cache-gib).")] = None,
    block_size: Annotated[int | None, vllm_option(help="Tokens per KV-cache block (default 16).")] = None,
    enable_prefix_caching: Annotated[bool | None, vllm_option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse cached prompt prefixes (default on).")] = None,
    structured_outputs_config: Annotated[str | None, vllm_option(
        help="JSON: backend (auto, llguidance, xgrammar), disable_any_whitespace, disable_additional_properties.")
    ] = None,
    enable_auto_tool_choice: Annotated[bool | None, vllm_option(
        "--enable-auto-tool-choice/--no-enable-auto-tool-choice", help="Allow tool_choice auto (needs "
        "--tool-call-parser).")] = None,
    tool_call_parser: Annotated[str | None, vllm_option(
        help="hermes, llama3_json, mistral or pythonic: how tool calls are read from the output.")] = None,
    reasoning_parser: Annotated[str | None, vllm_option(
        help="deepseek_r1 or qwen3: <think>...</think> becomes reasoning_content.")] = None,
    uvicorn_log_level: Annotated[str | None, vllm_option(
        help="The HTTP server's own log level (api.log_level, default warning); hybridlb's log lines follow "
             "HYBRIDLB_LOG_LEVEL (default INFO).")] = None,
    migration_limit: Annotated[int | None, typer.Option(
        help="Dense models: moves of one request to a sibling engine when its engine dies mid-stream "
             "(default 3, 0: off).")] = None,
    kv_events_config: Annotated[str | None, vllm_option(
        help="KV-cache events as JSON, vLLM's keys, e.g. '{\"enable_kv_cache_events\": true}'.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda.")] = None,
    dtype: Annotated[str | None, vllm_option(help="auto, float32, bfloat16 or float16.")] = None,
    quantization: Annotated[str | None, vllm_option(
        "--quantization", "-q", help="Keep weights quantized (CPU): int8, int4, or gguf (a .gguf file's own "
        "4-bit blocks).")] = None,
    speculative_config: Annotated[str | None, vllm_option(
        help="Speculative decoding as JSON, vLLM's keys, e.g. '{\"method\": \"ngram\", "
             "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'.")] = None,
    enable_lora: Annotated[bool, vllm_option(
        "--enable-lora", help="Serve LoRA adapters: a request names one in `model` (see docs/lora.md).")] = False,
    lora_modules: Annotated[list[str] | None, vllm_option(
        help="Adapters served from the start: name=path, or JSON {\"name\", \"path\", \"base_model_name\"}; "
             "repeat it, or list several after it as vLLM does.")] = None,
    max_loras: Annotated[int | None, vllm_option(help="Adapters one engine holds at once (default 1).")] = None,
    max_lora_rank: Annotated[int | None, vllm_option(help="Highest adapter rank accepted (default 16).")] = None,
    max_cpu_loras: Annotated[int | None, vllm_option(
        help="Adapters an engine keeps read in memory (default: --max-loras).")] = None,
    lora_load: Annotated[str | None, typer.Option(
        help="lazy (default): engines read an adapter when a request first needs it; eager: when it is "
             "registered (start-up or /v1/load_lora_adapter).")] = None,
    lora_allowed_root: Annotated[list[str] | None, typer.Option(
        help=LoRAConfig.model_fields["allowed_roots"].description + " Repeat it for several.")] = None,
    seed: Annotated[int | None, vllm_option(help="Sampling seed of requests that give none (default 0).")] = None,
    enforce_eager: Annotated[bool, vllm_option(
        "--enforce-eager", help="Run every step layer by layer from Python, not decode steps as the recorded "
        "decode program (for debugging and profiling).")] = False,
    torch_threads: Annotated[int | None, typer.Option(help="Threads per engine (0: split the cores).")] = None,
    share_cores: Annotated[bool | None, typer.Option(
        "--share-cores/--no-share-cores",
        help="An engine stepping while the node's others idle uses their cores too (default on).")] = None,
    enable_expert_parallel: EXPERT_PARALLEL = None,
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
    cluster_token: Annotated[str | None, typer.Option(envvar="HYBRIDLB_CLUSTER_TOKEN",
                                                      help="Shared secret for joining the cluster.")] = None,
    restart_policy: Annotated[str | None, typer.Option(
        help="none (default): report a dead part and serve on; restart: bring it back in place.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check the command and print the cluster plan and this node's part; start nothing.")] = False,
    parallel: dict[str, Any] | None = None,
):
    """Serve the OpenAI API from this node: its engines and API servers, no Ray (see SERVE_HELP)."""
    with stopped_before_start():
        problems = given_on_the_command_line(context)  # the vLLM flags hybridlb refused, listed with the rest
        layout = parallel_overrides(parallel, problems)
        layout["data_parallel"].update(cluster_token=cluster_token, restart_policy=restart_policy)
        layout["lb"]["policy"] = lb_policy
        cfg = build_config(config, model, {
            "engine": dict(revision=revision, tokenizer=tokenizer,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs, device=device, dtype=dtype,
                           quantization=quantization, max_queued_requests=max_queued_requests,
                           max_num_batched_tokens=max_num_batched_tokens, kv_cache_gib=kv_cache_gib,
                           gpu_memory_utilization=gpu_memory_utilization,
                           block_size=block_size, seed=seed, torch_threads=torch_threads,
                           enforce_eager=enforce_eager or None,
                           share_cores=share_cores, prefix_caching=enable_prefix_caching,
                           kv_events=json_flag("--kv-events-config", kv_events_config, problems),
                           structured_outputs=json_flag("--structured-outputs-config", structured_outputs_config,
                                                        problems),
                           speculative=json_flag("--speculative-config", speculative_config, problems),
                           lora=lora_flags(enable_lora, lora_modules, problems, max_loras=max_loras,
                                           max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras, load=lora_load,
                                           allowed_roots=lora_allowed_root),
                           expert_parallel=enable_expert_parallel, async_dp_coordination=async_dp_coordination,
                           dp_timeout_s=dp_timeout,
                           simulate=_simulate_flags(simulate_step_ms, simulate_per_token_ms, problems)),
            "api": dict(host=host, port=port, served_model_name=served_names(served_model_name), api_key=api_key,
                        max_concurrent_requests=max_concurrent_requests, request_timeout_s=request_timeout,
                        chat_template=chat_template, generation_config=generation_config,
                        enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser, migration_limit=migration_limit,
                        log_level=uvicorn_log_level),
            **layout,
        }, problems)
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


@with_options(PARALLEL, into="parallel")
def plan(
    model: Annotated[str | None, typer.Option(help=MODEL_HELP + " Read for dense vs MoE.")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML config; flags override it.")] = None,
    host: Annotated[str | None, typer.Option(help="HTTP interface.")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port.")] = None,
    enable_expert_parallel: EXPERT_PARALLEL = None,
    parallel: dict[str, Any] | None = None,
):
    """Print the rank map (nodes → ranks → API servers → ports), or every problem with its fix."""
    from hybridlb.plan import format_plan

    problems = Problems()
    cfg = build_config(config, model or ("(none)" if config is None else None), {
        "engine": dict(expert_parallel=enable_expert_parallel),
        "api": dict(host=host, port=port),
        **parallel_overrides(parallel, problems),
    }, problems)
    cluster, _ = plan_of(cfg, problems) if cfg is not None else (None, None)
    problems.raise_any()
    typer.echo(format_plan(cluster))


def _simulate_flags(step_ms: float | None, per_token_ms: float | None, problems: Problems) -> dict | None:
    """engine.simulate from the flags (None: not given, the config file decides)."""
    if step_ms is None:
        if per_token_ms is not None:
            problems.add("--simulate-per-token-ms needs --simulate-step-ms")
        return None
    return {"step_ms": step_ms, "per_token_ms": per_token_ms or 0.0}


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

    engine = cfg.engine
    dtype = engine_dtype(engine)
    max_len = load_spec(engine.model).model_len(engine.max_model_len)
    return (f"model {cfg.served_model_names}, dtype {dtype}"
            + (" (auto)" if engine.dtype == "auto" else "")
            + (f", weights {engine.quantization}" if engine.quantization else "")
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
