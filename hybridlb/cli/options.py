"""What the commands share: options added to a command (``with_options``; the config's own come
from ``config_flags``), Ctrl-C before the start, and the Config built from ``--config`` plus
flags, with its cluster plan and checkpoint checks. The helpers that read flags add what is
wrong to a ``Problems`` list and go on, so that a command reports every problem of its command
line at once."""

from __future__ import annotations

import contextlib
import functools
import inspect
from pathlib import Path
from typing import Annotated, Any

import typer

from hybridlb.cli.problems import Problems, Refusal, fail
from hybridlb.config import Config, ConfigError, EngineConfig, parse_config, read_config_file

CONFIG = Annotated[Path | None, typer.Option(help="YAML config; flags override it.")]


@contextlib.contextmanager
def stopped_before_start():
    """Ctrl-C before a launcher takes the signals (reading the config, the model, the plan)
    exits 130 with one line, as after (typer alone would exit 130 without a word)."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo("SIGINT: stopping (nothing was started yet)", err=True)
        raise typer.Exit(130) from None


def with_options(options: dict[str, Any], into: str):
    """A command also takes ``options`` (parameter name → its Annotated type; all default to
    None) and receives their values as one dict, its parameter ``into``."""

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != into]
        assert not {p.name for p in own} & set(options), "a command's own parameter shadows an option"
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
                 for name, kind in options.items()]

        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            values = {name: kwargs.pop(name, None) for name in options}
            return command(*args, **kwargs, **{into: values})

        wrapper.__signature__ = signature.replace(parameters=[*own, *added])
        return wrapper

    return decorate


def build_config(config: Path | None, overrides: dict[str, dict], problems: Problems | None = None,
                 pin_hub: bool = True) -> Config | None:
    """A Config from an optional YAML file, with the flags on top.

    ``overrides`` maps a section name to the flag values for it (``config_flags.overrides``); a
    ``--model`` replaces the file's model and its ``make_if_missing``. The file
    and the flags are validated together, so every mistake in either is listed at once: added
    to ``problems`` (and None returned), or without it refused at once. A hub ID as model is
    taken from the local Hugging Face cache here (``pin_hub=False``: left for where it runs).
    """
    gathered = Problems() if problems is None else problems
    cfg = None
    with gathered.gather():
        cfg = _merged_config(config, overrides, pin_hub)
    if problems is None:
        gathered.raise_any()
    return cfg


def _merged_config(config: Path | None, overrides: dict[str, dict], pin_hub: bool) -> Config:
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
    if overrides.get("engine", {}).get("model") is not None:
        engine.pop("make_if_missing", None)  # the file's checkpoint to make is not the model given
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
    if cfg.engine.backend == "vllm":
        from hybridlb.engine.vllm_backend import VllmUnavailable, check_installed

        try:
            check_installed()
        except VllmUnavailable as exc:
            fail(str(exc))


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
