"""What the commands share: option declarations (each declared once), the error exit, and
the Config built from ``--config`` plus flags, with its cluster plan and checkpoint checks.
The helpers that read flags add what is wrong to a ``Problems`` list and go on, so that a
command reports every problem of its command line at once."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from hybridlb.cli.problems import Problems, Refusal, fail
from hybridlb.config import Config, ConfigError, EngineConfig, parse_config, read_config_file

# --help marks the flags vLLM also has (same name and meaning) apart from hybridlb's own.
VLLM_MARK = "[vLLM]"
MODEL_HELP = ("Checkpoint: a Hugging Face directory, a .gguf file, package:DIST/PATH, or a hub ID (org/name) "
              "in the local Hugging Face cache.")


@contextlib.contextmanager
def stopped_before_start():
    """Ctrl-C before a launcher takes the signals (reading the config, the model, the plan)
    exits 130 with one line, as after (typer alone would exit 130 without a word)."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo("SIGINT: stopping (nothing was started yet)", err=True)
        raise typer.Exit(130) from None


def vllm_option(*names: str, help: str | None = None) -> typer.models.OptionInfo:
    """An option vLLM also has, with its name and meaning (marked VLLM_MARK in --help)."""
    return typer.Option(*names, help=f"{help} {VLLM_MARK}" if help else VLLM_MARK)


def _option(*names: str, help: str, vllm: bool = True) -> typer.models.OptionInfo:
    return vllm_option(*names, help=help) if vllm else typer.Option(*names, help=help)


# The data-parallel layout of the cluster and this node's part in it: ``serve`` and ``plan``
# take these (``with_options``), as data_parallel.* / lb.* overrides.
PARALLEL = {
    "data_parallel_size": Annotated[int | None, _option("--data-parallel-size", "-dp",
                                                        help="Ranks in the whole cluster.")],
    "data_parallel_size_local": Annotated[int | None, _option("--data-parallel-size-local",
                                                              help="Ranks on this node.")],
    "data_parallel_start_rank": Annotated[int | None, _option("--data-parallel-start-rank",
                                                              help="This node's first rank.")],
    "data_parallel_rank": Annotated[int | None, _option("--data-parallel-rank",
                                                        help="External LB: serve only this rank.")],
    "data_parallel_address": Annotated[str | None, _option("--data-parallel-address", help="The head node's address.")],
    "data_parallel_rpc_port": Annotated[int | None, _option("--data-parallel-rpc-port",
                                                            help="The head's handshake port.")],
    "data_parallel_node_address": Annotated[str | None, _option(
        "--data-parallel-node-address", help="This node's address for other nodes (internal LB).")],
    "headless": Annotated[bool | None, _option("--headless/--no-headless", help="Engines only, no API server.")],
    "lb_mode": Annotated[str | None, _option("--lb-mode", help="hybrid (default), internal, external or multi_port.",
                                             vllm=False)],
    "api_servers_per_node": Annotated[str | None, _option("--api-servers-per-node", help="N or auto.", vllm=False)],
    "data_parallel_supervisor_port": Annotated[int | None, _option(
        "--data-parallel-supervisor-port", help="Multi-port: the node supervisor's port (/health, /readyz; "
        "default 9256).")],
    "dp_supervisor_probe_interval_s": Annotated[float | None, _option(
        "--dp-supervisor-probe-interval-s", help="Multi-port: seconds between probes of each rank (default 5).")],
    "dp_supervisor_probe_timeout_s": Annotated[float | None, _option(
        "--dp-supervisor-probe-timeout-s", help="Multi-port: seconds one probe may take (default 5).")],
    "dp_supervisor_probe_failure_threshold": Annotated[int | None, _option(
        "--dp-supervisor-probe-failure-threshold", help="Multi-port: failed probes before a rank is down "
        "(default 3).")],
}
# Field of the config section each PARALLEL flag sets.
_PARALLEL_FIELDS = {
    "data_parallel_size": ("data_parallel", "size"), "data_parallel_size_local": ("data_parallel", "size_local"),
    "data_parallel_start_rank": ("data_parallel", "start_rank"), "data_parallel_rank": ("data_parallel", "rank"),
    "data_parallel_address": ("data_parallel", "address"), "data_parallel_rpc_port": ("data_parallel", "rpc_port"),
    "data_parallel_node_address": ("data_parallel", "node_address"), "headless": ("data_parallel", "headless"),
    "lb_mode": ("lb", "mode"), "api_servers_per_node": ("lb", "api_servers_per_node"),
    "data_parallel_supervisor_port": ("lb", "supervisor_port"),
    "dp_supervisor_probe_interval_s": ("lb", "supervisor_probe_interval_s"),
    "dp_supervisor_probe_timeout_s": ("lb", "supervisor_probe_timeout_s"),
    "dp_supervisor_probe_failure_threshold": ("lb", "supervisor_probe_failure_threshold"),
}
EXPERT_PARALLEL = Annotated[bool | None, _option("--enable-expert-parallel/--no-enable-expert-parallel",
                                                 help="MoE: shard experts over the DP ranks.")]


def with_options(options: dict[str, Any], into: str):
    """A command also takes ``options`` (parameter name → its Annotated type; all default to
    None) and receives their values as one dict, its parameter ``into``."""

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != into]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
                 for name, kind in options.items()]

        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            values = {name: kwargs.pop(name, None) for name in options}
            return command(*args, **kwargs, **{into: values})

        wrapper.__signature__ = signature.replace(parameters=[*own, *added])
        return wrapper

    return decorate


def parallel_overrides(flags: dict[str, Any], problems: Problems) -> dict[str, dict]:
    """Config overrides (section → fields) from the PARALLEL flags' values."""
    sections: dict[str, dict] = {"data_parallel": {}, "lb": {}}
    for name, value in flags.items():
        section, field = _PARALLEL_FIELDS[name]
        sections[section][field] = value
    if sections["lb"].get("mode"):
        sections["lb"]["mode"] = sections["lb"]["mode"].replace("-", "_")  # multi-port, as vLLM users write it
    servers = sections["lb"].get("api_servers_per_node")
    if servers not in (None, "auto"):
        if not servers.isdigit():
            problems.add(f"--api-servers-per-node takes a number or 'auto', got {servers!r}")
            servers = None
        sections["lb"]["api_servers_per_node"] = servers and int(servers)
    return sections


def served_names(names: list[str] | None) -> str | list[str] | None:
    """api.served_model_name from the --served-model-name flags (None: not given)."""
    return names[0] if names and len(names) == 1 else names or None


def json_flag(name: str, text: str | None, problems: Problems) -> dict | None:
    """A flag whose value is a JSON object (vLLM's --kv-events-config), or None if not given (or wrong)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        problems.add(f"{name} is not valid JSON ({exc}); give an object, e.g. '{{\"enable_kv_cache_events\": true}}'")
        return None
    if not isinstance(value, dict):
        problems.add(f"{name} must be a JSON object, got {text!r}")
        return None
    return value


# engine.lora keys whose flag is not --KEY.
_LORA_FLAG_NAMES = {"load": "--lora-load", "allowed_roots": "--lora-allowed-root"}


def lora_flags(enable: bool, modules: list[str] | None, problems: Problems,
               **limits: int | str | list[str] | None) -> dict | None:
    """engine.lora from --enable-lora, --lora-modules (name=path or vLLM's JSON form), the
    --max-lora* limits, --lora-load and --lora-allowed-root; None when none is given (the config
    file decides)."""
    given = {key: value for key, value in limits.items() if value is not None}
    if not enable:
        if modules or given:
            flags = ["--lora-modules"] * bool(modules) + [
                _LORA_FLAG_NAMES.get(key, f"--{key.replace('_', '-')}") for key in given]
            problems.add(f"{', '.join(flags)} needs --enable-lora; add it")
        return None
    entries = []
    for text in modules or []:
        if text.lstrip().startswith("{"):
            entry = json_flag("--lora-modules", text, problems)
        else:
            name, equals, path = text.partition("=")
            entry = {"name": name, "path": path} if equals and name and path else None
            if entry is None:
                problems.add(f"--lora-modules {text!r}: write name=path (or JSON with name, path, base_model_name)")
        if entry is not None:
            entries.append(entry)
    return {"modules": entries, **given}


def build_config(config: Path | None, model: str | None, overrides: dict[str, dict],
                 problems: Problems | None = None, pin_hub: bool = True) -> Config | None:
    """A Config from an optional YAML file, with ``--model`` and other flags on top.

    ``overrides`` maps a section name to the flag values for it; None means not given. The file
    and the flags are validated together, so every mistake in either is listed at once: added
    to ``problems`` (and None returned), or without it refused at once. A hub ID as model is
    taken from the local Hugging Face cache here (``pin_hub=False``: left for where it runs).
    """
    gathered = Problems() if problems is None else problems
    cfg = None
    with gathered.gather():
        cfg = _merged_config(config, model, overrides, pin_hub)
    if problems is None:
        gathered.raise_any()
    return cfg


def _merged_config(config: Path | None, model: str | None, overrides: dict[str, dict], pin_hub: bool) -> Config:
    try:
        data = read_config_file(config) if config else {}
    except ConfigError as exc:
        fail(str(exc))
    if not isinstance(data, dict):
        fail(f"{config}: expected a mapping at the top level, got {type(data).__name__}")
    # A section that is not a mapping takes no flags; validation names it.
    sections = {name: dict(data.get(name) or {}) for name in {"engine", *overrides}
                if isinstance(data.get(name) or {}, dict)}
    engine = sections.get("engine", {})
    if model is not None:
        engine["model"] = model
        engine.pop("make_if_missing", None)
    for name, values in overrides.items():
        if name in sections:
            sections[name].update({k: v for k, v in values.items() if v is not None})
    if "engine" in sections and "model" not in engine:
        fail("no model given: pass --model DIR|FILE.gguf or --config FILE.yaml (try configs/local.yaml)")
    try:
        cfg = parse_config({**data, **sections}, str(config or "flags"))
        return pinned_hub_model(cfg) if pin_hub else cfg
    except ConfigError as exc:
        raise Refusal(exc.problems) from None


def pinned_hub_model(cfg: Config) -> Config:
    """``cfg`` with a hub ID as model taken from the local Hugging Face cache, once for the whole process tree."""
    from hybridlb.checkpoint.path import CheckpointError
    from hybridlb.checkpoint.pin import pin_hub_model

    try:
        cfg, note = pin_hub_model(cfg)
    except CheckpointError as exc:
        fail(str(exc))
    if note:
        typer.echo(f"note: {note}", err=True)
    return cfg


def plan_of(cfg: Config, problems: Problems | None = None):
    """The cluster plan and this node's part of it; every problem with it is added to ``problems``
    (then both are None), or without it refused at once."""
    from hybridlb.checkpoint.spec import CheckpointError, load_spec
    from hybridlb.plan import PlanError, plan_cluster

    try:
        is_moe = load_spec(cfg.engine.model).is_moe
    except CheckpointError:
        is_moe = None  # `plan` may run where the checkpoint is not
    try:
        plan = plan_cluster(cfg, is_moe)
    except PlanError as exc:
        if problems is None:
            raise Refusal(exc.problems) from None
        problems.extend(exc.problems)
        return None, None
    start = cfg.data_parallel.rank if cfg.data_parallel.rank is not None else cfg.data_parallel.start_rank
    node = next((n for n in plan.nodes if n.start_rank == start), plan.nodes[0])
    return plan, node


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
    from hybridlb.checkpoint.chat_template import read_template_argument
    from hybridlb.checkpoint.generation_config import sampling_defaults
    from hybridlb.checkpoint.path import CheckpointError, resolve

    try:
        checkpoint = resolve(cfg.engine.model)
        if cfg.engine.quantization == "gguf" and not checkpoint.is_gguf:
            fail(f"--quantization gguf keeps a .gguf file's weights quantized, but {cfg.engine.model} is not a "
                 ".gguf file; use int8 or int4 to quantize it at load")
        if cfg.api.chat_template:
            read_template_argument(cfg.api.chat_template)
        sampling_defaults(cfg.engine.model, cfg.api.generation_config)
    except CheckpointError as exc:
        fail(str(exc))
    check_lora_modules(cfg)


def check_lora_modules(cfg: Config) -> None:
    """Fail before anything starts on an adapter (--lora-modules) the engines could not serve."""
    from hybridlb.checkpoint.lora import AdapterError, check_adapter

    lora = cfg.engine.lora
    for module in lora.modules if lora else []:
        if module.name in cfg.served_model_names:
            fail(f"--lora-modules {module.name}: that is the base model's served name; give the adapter another")
        try:
            check_adapter(module.path, cfg.engine.model, lora.max_lora_rank)
        except AdapterError as exc:
            fail(f"--lora-modules {module.name}: {exc}")
