"""``hybridlb status / down``: a cluster ``hybridlb up`` placed on Ray, found by its actors' and
placement group's names (``hybridlb:<name>:...`` in the configured namespace), reported and removed."""

from __future__ import annotations

import contextlib

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridlb.launch.ray_actors import remove_runtime_dir
from hybridlb.launch.ray_session import attach


def _remove_runtime_dirs(name: str, group) -> None:
    """Remove the cluster's directory on each of its nodes (one task per bundle)."""
    tasks = [remove_runtime_dir.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index)).remote(name)
        for index in range(len(group.bundle_specs))]
    with contextlib.suppress(Exception):
        ray.get(tasks, timeout=20)


def named(namespace: str, prefix: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith(prefix)) + _groups(prefix)


def _groups(prefix: str) -> list[str]:
    table = ray.util.placement_group_table()
    return [pg["name"] for pg in table.values() if pg["name"].startswith(prefix) and pg["state"] != "REMOVED"]


def status(name: str, address: str | None, namespace: str) -> list[dict]:
    """Every actor of cluster ``name``: its state, node and (engines) load."""
    attach(address, namespace)
    from ray.util.state import list_actors

    prefix = f"hybridlb:{name}:"
    rows = []
    for actor in list_actors(filters=[("ray_namespace", "=", namespace)], limit=10_000):
        if not (actor.name or "").startswith(prefix):
            continue
        row = {"name": actor.name, "state": actor.state, "node": (actor.node_id or "")[:12], "load": ""}
        if actor.state == "ALIVE" and ":engine:" in actor.name:
            try:
                stats = ray.get(ray.get_actor(actor.name, namespace).stats.remote(), timeout=5)
                row["load"] = f"running {stats['num_running']}, waiting {stats['num_waiting']}, " \
                              f"kv {stats['kv_usage']:.0%}" + ("" if stats["alive"] else " (engine loop stopped)")
            except Exception as exc:
                row["load"] = f"no answer ({type(exc).__name__})"
        rows.append(row)
    return sorted(rows, key=lambda r: r["name"])


def down(name: str, address: str | None = None, namespace: str = "hybridlb", quiet: bool = False) -> int:
    """Stop and remove every actor and the placement group of cluster ``name``."""
    attach(address, namespace)
    prefix = f"hybridlb:{name}:"
    names = [n for n in named(namespace, prefix) if not n.endswith(":pg")]
    for actor_id in names:
        # Ask for a clean stop first (closes sockets), then make sure it is gone.
        with contextlib.suppress(Exception):
            ray.get(ray.get_actor(actor_id, namespace).stop.remote(), timeout=10)
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(actor_id, namespace), no_restart=True)
    groups = _groups(prefix)
    for group_name in groups:
        group = ray.util.get_placement_group(group_name)
        _remove_runtime_dirs(name, group)
        remove_placement_group(group)
    if not quiet and (names or groups):  # nothing found: the CLI says so, in one line
        print(f"stopped {len(names)} actors and {len(groups)} placement group(s) of {name!r}")
    return 0 if names or groups else 1
