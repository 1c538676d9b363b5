"""``hybridlb status --url``: what one API server sees, for people (any launcher)."""

from __future__ import annotations

import httpx


class StatusError(RuntimeError):
    """No hybridlb API server answered at the URL."""


def server_status(url: str, api_key: str | None = None) -> tuple[str, bool]:
    """A table of the server's engines and its problems; and whether /health says it can serve."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        health = httpx.get(f"{url}/health", timeout=10)
        ranks = httpx.get(f"{url}/ranks", timeout=10, headers=headers)
        if ranks.status_code == 401:
            raise StatusError(f"{url} wants an API key: pass --api-key or set HYBRIDLB_API_KEY")
        view = ranks.json()
        body = health.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise StatusError(f"no hybridlb API server answers at {url}: {exc}") from None
    state = body.get("status") or "down: " + body.get("error", {}).get("message", "?")
    lines = [f"node {view['node']} ({view['api_server']}, {view['mode']} LB): {state}",
             f"{'rank':<6}{'state':<8}{'running':>8}{'waiting':>8}{'kv':>7}{'cached':>8}{'hits':>6}{'rss MiB':>9}"]
    for engine in view["engines"]:
        alive = "up" if engine["alive"] else "DOWN"
        lines.append(f"{engine['rank']:<6}{alive:<8}{engine['num_running']:>8}{engine['num_waiting']:>8}"
                     f"{engine['kv_usage']:>7.0%}{_cached(engine):>8}{engine.get('prefix_hit_rate', 0):>6.0%}"
                     f"{engine.get('rss_mib', 0):>9.0f}")
    lines += [f"problem: {problem}" for problem in view.get("problems", [])]
    return "\n".join(lines), health.status_code == 200


def _cached(engine: dict) -> str:
    """Share of the KV pool holding reusable prefix blocks."""
    total = engine.get("num_kv_blocks") or 0
    return f"{engine.get('cached_blocks', 0) / total:.0%}" if total else "-"
