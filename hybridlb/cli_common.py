"""What the CLI modules share: the ``--data-parallel-*`` flag declarations, their mapping onto
config overrides, the error exit, and the Config built from ``--config`` plus flags."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from pathlib import Path

    from hybridlb.config import Config


# --help lists the flags vLLM also has (same name and meaning) apart from hybridlb's own.
VLLM_FLAGS = "Flags with vLLM's names and meaning (its short forms and underscores work too)"


def fail(message: str) -> None:
    """Print ``error: message`` in red and exit 2."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


DpSize = Annotated[int | None, typer.Option("--data-parallel-size", "-dp", help="Ranks in the whole cluster.", rich_help_panel=VLLM_FLAGS)]
DpSizeLocal = Annotated[int | None, typer.Option("--data-parallel-size-local", help="Ranks on this node.", rich_help_panel=VLLM_FLAGS)]
DpStartRank = Annotated[int | None, typer.Option("--data-parallel-start-rank", help="This node's first rank.", rich_help_panel=VLLM_FLAGS)]
DpRank = Annotated[int | None, typer.Option("--data-parallel-rank", help="External LB: serve only this rank.", rich_help_panel=VLLM_FLAGS)]
DpAddress = Annotated[str | None, typer.Option("--data-parallel-address", help="The head node's address.", rich_help_panel=VLLM_FLAGS)]
DpRpcPort = Annotated[int | None, typer.Option("--data-parallel-rpc-port", help="The head's handshake port.", rich_help_panel=VLLM_FLAGS)]
DpNodeAddress = Annotated[str | None, typer.Option("--data-parallel-node-address",
                                                   help="This node's address for other nodes (internal LB).", rich_help_panel=VLLM_FLAGS)]
Headless = Annotated[bool | None, typer.Option("--headless/--no-headless", help="Engines only, no API server.", rich_help_panel=VLLM_FLAGS)]
LbMode = Annotated[str | None, typer.Option("--lb-mode", help="hybrid (default), internal or external.")]
ApiServers = Annotated[str | None, typer.Option("--api-servers-per-node", help="N or auto.")]
ClusterToken = Annotated[str | None, typer.Option("--cluster-token", envvar="HYBRIDLB_CLUSTER_TOKEN",
                                                  help="Shared secret for joining the cluster.")]


def parallel_overrides(size, size_local, start_rank, rank, address, rpc_port, node_address, headless, lb_mode,
                       api_servers, cluster_token, lb_policy=None) -> dict[str, dict]:
    servers = api_servers if api_servers in (None, "auto") else int_flag("--api-servers-per-node", api_servers)
    return {
        "data_parallel": dict(size=size, size_local=size_local, start_rank=start_rank, rank=rank, address=address,
                              rpc_port=rpc_port, node_address=node_address, headless=headless,
                              cluster_token=cluster_token),
        "lb": dict(mode=lb_mode, api_servers_per_node=servers, policy=lb_policy),
    }


def int_flag(name: str, value: str) -> int:
    if not value.isdigit():
        fail(f"{name} takes a number or 'auto', got {value!r}")
    return int(value)


def served_names(names: list[str] | None) -> str | list[str] | None:
    """api.served_model_name from the --served-model-name flags (None: not given)."""
    return names[0] if names and len(names) == 1 else names or None


def json_flag(name: str, text: str | None) -> dict | None:
    """A flag whose value is a JSON object (vLLM's --kv-events-config), or None if not given."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"{name} is not valid JSON ({exc}); give an object, e.g. '{{\"enable_kv_cache_events\": true}}'")
    if not isinstance(value, dict):
        fail(f"{name} must be a JSON object, got {text!r}")
    return value


def simulate_flags(step_ms: float | None, per_token_ms: float | None) -> dict | None:
    """engine.simulate from the flags (None: not given, the config file decides)."""
    if step_ms is None:
        if per_token_ms is not None:
            fail("--simulate-per-token-ms needs --simulate-step-ms")
        return None
    return {"step_ms": step_ms, "per_token_ms": per_token_ms or 0.0}


def plan_of(cfg: Config):
    """The cluster plan and this node's part of it, or a clean exit listing every problem."""
    from hybridlb.model.spec import CheckpointError, load_spec
    from hybridlb.plan import PlanError, plan_cluster

    try:
        is_moe = load_spec(cfg.engine.model).is_moe
    except CheckpointError:
        is_moe = None  # `plan` may run where the checkpoint is not
    try:
        plan = plan_cluster(cfg, is_moe)
    except PlanError as exc:
        fail(str(exc))
    start = cfg.data_parallel.rank if cfg.data_parallel.rank is not None else cfg.data_parallel.start_rank
    node = next((n for n in plan.nodes if n.start_rank == start), plan.nodes[0])
    return plan, node


def build_config(config: Path | None, model: str | None, overrides: dict[str, dict]) -> Config:
    """A Config from an optional YAML file, with ``--model`` and other flags on top.

    ``overrides`` maps a section name to the flag values for it; None means not given.
    """
    from hybridlb.config import ConfigError, load_config, parse_config

    try:
        data = load_config(config).model_dump(exclude_unset=True) if config else {}
    except ConfigError as exc:
        fail(str(exc))
    sections = {name: dict(data.get(name, {})) for name in overrides}
    sections.setdefault("engine", dict(data.get("engine", {})))
    if model is not None:
        sections["engine"]["model"] = model
        sections["engine"].pop("make_if_missing", None)
    for name, values in overrides.items():
        sections[name].update({k: v for k, v in values.items() if v is not None})
    if "model" not in sections["engine"]:
        fail("no model given: pass --model DIR|FILE.gguf or --config FILE.yaml (try configs/local.yaml)")
    try:
        return parse_config({**data, **sections}, str(config or "flags"))
    except ConfigError as exc:
        fail(str(exc))
