"""What a start checks before it starts anything, in the one function ``serve``, its ``--dry-run``
and ``up`` all call (``check_start``), so a dry run refuses and warns exactly where the start would.

It checks the checkpoint and the model options, the cluster plan and the ports this machine
will listen on, adding every problem to the command's ``Problems`` list. It prints the start's
warnings; those a component logs itself once it runs (an engine, the rpc handshake) only on a
dry run, so that a real start says each once.
"""

from __future__ import annotations

import typer

from hybridlb.cli.options import check_model_options, ensure_checkpoint, plan_of
from hybridlb.cli.problems import Problems
from hybridlb.config import Config
from hybridlb.plan import ClusterPlan, NodePlan


def check_start(cfg: Config, problems: Problems, *, dry_run: bool = False,
                cluster: bool = False) -> tuple[ClusterPlan | None, NodePlan | None]:
    """Check what starting ``cfg`` needs, adding each problem to ``problems``, and print its warnings.

    ``cluster``: ``hybridlb up``, which places every node (their ports are tried where they are on
    this machine); else this node of ``serve``. Returns the plan and this node's part of it (both
    None when the plan is impossible)."""
    with problems.gather():
        ensure_checkpoint(cfg.engine)
        check_model_options(cfg)
    plan, node = plan_of(cfg, problems)
    warnings = _warnings(cfg)
    if dry_run and plan is not None:
        warnings += _said_later(cfg, plan, node)
    if plan is not None:
        found, not_tried = _try_ports(cfg, plan, node, cluster)
        problems.extend(found)
        warnings += not_tried
    for warning in warnings:
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
    return plan, node


def _warnings(cfg: Config) -> list[str]:
    """What the start itself warns about, before anything runs."""
    simulate = cfg.engine.simulate
    if simulate is None:
        return []
    return [f"SIMULATED engines ({simulate.step_ms:g} ms per step, no model loaded): for control-plane "
            "benchmarks only"]


def _said_later(cfg: Config, plan: ClusterPlan, node: NodePlan) -> list[str]:
    """The warnings a real start's components log as they start (the dry run has no components)."""
    from hybridlb.transport import cluster_token

    dp = cfg.data_parallel
    said = [cfg.engine.kv_cache_size_note(cfg.engine.device)]
    if node.is_head and plan.joins_cluster and not cluster_token(dp.cluster_token):
        said.append(dp.open_handshake_warning())
    return [warning for warning in said if warning is not None]


def _try_ports(cfg: Config, plan: ClusterPlan, node: NodePlan, cluster: bool) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the ports this machine will listen on."""
    from hybridlb.launch.ports import node_listeners, try_ports

    if not cluster:
        return try_ports(node_listeners(cfg, plan, node))
    if cfg.ray.address is not None:
        typer.echo("note: ports are not tried here: Ray places the nodes on the machines of the cluster at "
                   f"{cfg.ray.address}, where each part binds its own", err=True)
        return [], []
    # A private Ray cluster: every node runs on this machine. Ray draws the coordinator's ports itself.
    problems, owner = [], {}
    for each in plan.nodes:
        for listener in node_listeners(cfg, plan, each, head_block=False):
            where = (listener.host, listener.port)
            if where in owner and owner[where] != each.index:
                problems.append(f"port {listener.port} on {listener.host} is wanted by node {owner[where]} and node "
                                f"{each.index}, both on this machine (a private Ray cluster); give each node its own "
                                "data_parallel.nodes[].api_port")
            owner.setdefault(where, each.index)
    found, warnings = try_ports([listener for each in plan.nodes
                                 for listener in node_listeners(cfg, plan, each, head_block=False)])
    return problems + found, warnings
