"""Chaos soak: closed-loop load on a DP=4 dense node while its engines are killed and frozen.

Starts ``hybridlb serve`` with ``--data-parallel-size 4`` on one node (SmolLM2 by default, in
float32 so that greedy texts compare exactly; ``--restart-policy restart``). A clean pass first
gives each of ``--prompts`` chat prompts its greedy text (``--max-tokens``, ignore_eos). Then
``--concurrency`` closed-loop clients stream those prompts for ``--duration-s`` while, every
``--fault-every-s`` (±30 %), one engine picked at random gets a fault:

* ``kill``: SIGKILL; its streams migrate to a sibling, and the node restarts it;
* ``freeze``: SIGSTOP for ``--freeze-s``, then SIGCONT; the API server's stall watch (or the
  ZMTP heartbeat) finds it, its streams migrate, and it registers again once thawed.

Every ``--poison-every-s`` (±30 %) a poison request of a random kind joins the load (``POISONS``:
each of them once took every engine of a node down): out-of-vocabulary stop ids with min_tokens,
out-of-vocabulary allowed_token_ids, a 3 MB bad word, a LoRA adapter truncated on disk after it
was registered, a grammar that cannot compile. Each must get a 4xx, and no engine may restart
but the killed ones (the soak watches every engine's pid).

PASS when no request failed or hung (each has ``--request-timeout-s``), every text equals its
clean text, every poison got a 4xx, engines restarted exactly as often as they were killed, and
the API server's RSS over the second half of the run grows less than
``--max-slope`` MiB/min. Reported: requests, faults, ``hybridlb:migrated_requests_total``, the
latency of requests that were in flight at a fault against the others (P50, P99), and the
streams the fault reached: those in flight at it whose longest wait between two chunks is over
twice the calm streams' P99, by kind of fault. That pause is what a migration costs a client (detection, the
resend, the re-prefill of prompt and tokens so far).

Engines made to fail every step are not part of the mix: that needs a fault hook in a live
engine, which hybridlb does not ship (``tests/unit/test_silent_paths.py`` and ``tests/unit/test_blame.py``
cover it on a simulated engine).

    python benchmarks/chaos_soak.py [--duration-s 600] [--model PATH] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import SMOLLM2, Server, free_port, stamp

from hybridlb.model.make_model import make_adapter

PROMPTS = [f"Tell me fact number {i} about the sea, in one long sentence." for i in range(64)]
POISONS = {  # kind -> what the request adds to a one-token chat request
    "oov_stop_ids": {"min_tokens": 1, "stop_token_ids": [1_000_000_000]},
    "oov_allowed_ids": {"allowed_token_ids": [0, 10**9]},
    "bad_word_3mb": {"bad_words": ["ab" * (3 * 2**19)]},
    "truncated_adapter": {"model": "truncated"},
    "bad_grammar": {"structured_outputs": {"regex": "(unclosed"}},
}


@dataclass
class Record:
    prompt: int
    started: float
    ended: float = 0.0
    ok: bool = False
    error: str = ""
    max_gap: float = 0.0  # the longest wait between two chunks: a migration shows as one long pause


@dataclass
class Soak:
    server: Server
    max_tokens: int
    timeout_s: float
    started: float = 0.0
    clean: dict[int, str] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    faults: list[tuple[float, str, int]] = field(default_factory=list)  # (time, kind, rank)
    poisons: list[tuple[str, int, str]] = field(default_factory=list)  # (kind, HTTP status, error message)
    pids: dict[int, set[int]] = field(default_factory=dict)  # rank -> every pid its engine had
    rss: list[tuple[float, float]] = field(default_factory=list)  # (time, MiB) of the API server

    async def one(self, client: httpx.AsyncClient, prompt: int) -> Record:
        record = Record(prompt, time.monotonic())
        body = {"model": self.server.model, "messages": [{"role": "user", "content": PROMPTS[prompt]}],
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        text = []
        last = record.started
        try:
            async with asyncio.timeout(self.timeout_s):
                async with client.stream("POST", f"{self.server.url}/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            now = time.monotonic()
                            record.max_gap, last = max(record.max_gap, now - last) if text else 0.0, now
                            event = json.loads(line[6:])
                            if "error" in event:
                                raise RuntimeError(f"error event: {event['error']}")
                            text += [c["delta"].get("content") or "" for c in event["choices"]]
            got = "".join(text)
            if prompt in self.clean and got != self.clean[prompt]:
                raise RuntimeError(f"text differs from the clean run: {got[:80]!r} vs {self.clean[prompt][:80]!r}")
            self.clean.setdefault(prompt, got)
            record.ok = True
        except (TimeoutError, RuntimeError, httpx.HTTPError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.ended = time.monotonic()
        return record


def engine_pids(server: Server) -> dict[int, int]:
    """rank → pid of the node's engine processes (their titles are ``hybridlb:engine:N``)."""
    pids = {}
    for task in Path(f"/proc/{server.process.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                title = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except FileNotFoundError:
                continue
            if match := re.fullmatch(r"hybridlb:engine:(\d+)", title):
                pids[int(match[1])] = int(child)
    return pids


def api_rss_mib(server: Server) -> float:
    for task in Path(f"/proc/{server.process.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"hybridlb:api"):
                    status = Path(f"/proc/{child}/status").read_text()
                    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)[1]) / 1024
            except FileNotFoundError:
                continue
    return float("nan")


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of RSS over time."""
    if len(samples) < 3:
        return 0.0
    ts, ys = [t for t, _ in samples], [y for _, y in samples]
    mean_t, mean_y = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mean_t) ** 2 for t in ts)
    return 60 * sum((t - mean_t) * (y - mean_y) for t, y in samples) / var if var else 0.0


async def faults(soak: Soak, until: float, every_s: float, freeze_s: float, rng: random.Random) -> None:
    while (wait := every_s * rng.uniform(0.7, 1.3)) < until - time.monotonic() - freeze_s - 5:
        await asyncio.sleep(wait)
        pids = engine_pids(soak.server)
        rank = rng.choice(sorted(pids))
        kind = rng.choice(["kill", "freeze"])
        soak.faults.append((time.monotonic(), kind, rank))
        print(f"  {time.monotonic() - soak.started:6.1f} s: {kind} engine {rank} (pid {pids[rank]})", flush=True)
        if kind == "kill":
            os.kill(pids[rank], signal.SIGKILL)
        else:
            os.kill(pids[rank], signal.SIGSTOP)
            await asyncio.sleep(freeze_s)
            os.kill(pids[rank], signal.SIGCONT)


async def poisons(soak: Soak, client: httpx.AsyncClient, until: float, every_s: float,
                  rng: random.Random) -> None:
    while every_s > 0 and (wait := every_s * rng.uniform(0.7, 1.3)) < until - time.monotonic():
        await asyncio.sleep(wait)
        kind = rng.choice(sorted(POISONS))
        body = {"model": soak.server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                **POISONS[kind]}
        try:
            response = await client.post(f"{soak.server.url}/v1/chat/completions", json=body, timeout=60)
            message = response.json().get("error", {}).get("message", "") if response.status_code >= 400 else ""
            soak.poisons.append((kind, response.status_code, message[:200]))
        except (httpx.HTTPError, ValueError) as exc:
            soak.poisons.append((kind, 0, f"{type(exc).__name__}: {exc}"[:200]))
        print(f"  {time.monotonic() - soak.started:6.1f} s: poison {kind} -> {soak.poisons[-1][1]}", flush=True)


async def sample_rss(soak: Soak, until: float) -> None:
    while time.monotonic() < until:
        soak.rss.append((time.monotonic(), api_rss_mib(soak.server)))
        for rank, pid in engine_pids(soak.server).items():
            soak.pids.setdefault(rank, set()).add(pid)
        await asyncio.sleep(1)


async def run(soak: Soak, args) -> None:
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        # The clean pass: every prompt's greedy text, before any fault.
        clean = await asyncio.gather(*(soak.one(client, i) for i in range(args.prompts)))
        if not all(r.ok for r in clean):
            raise SystemExit(f"the clean pass failed: {[r.error for r in clean if not r.ok][:3]}")
        soak.started = time.monotonic()
        until = soak.started + args.duration_s
        rng = random.Random(args.seed)

        async def client_loop(worker: int) -> None:
            turn = worker
            while time.monotonic() < until:
                soak.records.append(await soak.one(client, turn % args.prompts))
                turn += args.concurrency

        await asyncio.gather(*(client_loop(w) for w in range(args.concurrency)),
                             faults(soak, until, args.fault_every_s, args.freeze_s, rng), sample_rss(soak, until),
                             poisons(soak, client, until, args.poison_every_s, random.Random(args.seed + 1)))


def migrated(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^hybridlb:migrated_requests_total\{[^}]*\} (\S+)$", text, re.M))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--fault-every-s", type=float, default=30)
    parser.add_argument("--freeze-s", type=float, default=15, help="past api.engine_stall_s (10 s)")
    parser.add_argument("--request-timeout-s", type=float, default=120)
    parser.add_argument("--max-slope", type=float, default=1.0, help="MiB/min of API-server RSS, second half")
    parser.add_argument("--poison-every-s", type=float, default=10, help="a poison request this often (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/chaos_soak.json"))
    args = parser.parse_args()

    adapter = make_adapter(args.model, Path(tempfile.mkdtemp(prefix="chaos-adapter-")) / "truncated",
                           ["q_proj", "v_proj"], rank=4)
    server = Server.hybridlb("chaos_soak", args.model, "--data-parallel-size", "4", "--data-parallel-rpc-port",
                             str(free_port()), "--restart-policy", "restart", "--dtype", "float32",
                             "--served-model-name", "chaos", "--kv-cache-gib", "0.5", "--enable-lora",
                             "--lora-modules", f"truncated={adapter}")
    server.model = "chaos"
    try:
        print(f"serve ready in {server.wait_ready():.0f} s; soaking for {args.duration_s:.0f} s", flush=True)
        weights = adapter / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-16])  # registered whole; its tensors no longer read
        soak = Soak(server, args.max_tokens, args.request_timeout_s)
        asyncio.run(run(soak, args))
        moved = migrated(server.url)
    finally:
        server.stop()

    failed = [r for r in soak.records if not r.ok]
    hit = [r for r in soak.records if r.ok and any(r.started < t < r.ended for t, _, _ in soak.faults)]
    calm = [r.ended - r.started for r in soak.records if r.ok and r not in hit]
    hit_s = [r.ended - r.started for r in hit]
    # Streams that paused at a fault (longest gap between chunks over twice the calm streams'
    # P99): those the fault reached, whose pause is what a migration costs (detection, resend,
    # re-prefill), by the kind of fault they were in flight at.
    calm_gap = pct([r.max_gap for r in soak.records if r.ok and r not in hit], 0.99)
    paused = [r.max_gap for r in hit if r.max_gap > 2 * calm_gap]
    by_kind = {}
    for kind in ("kill", "freeze"):
        gaps = [r.max_gap for r in hit if r.max_gap > 2 * calm_gap
                and any(k == kind and r.started < t < r.ended for t, k, _ in soak.faults)]
        by_kind[kind] = {"faults": sum(k == kind for _, k, _ in soak.faults), "paused_streams": len(gaps),
                         "pause_p50_s": pct(gaps, 0.5), "pause_max_s": max(gaps, default=float("nan"))}
    late = [s for s in soak.rss if s[0] >= soak.started + args.duration_s / 2]
    slope = slope_mib_per_min(late)
    kills = {rank: sum(k == "kill" and r == rank for _, k, r in soak.faults) for rank in soak.pids}
    restarts = {rank: len(pids) - 1 for rank, pids in soak.pids.items()}
    poisoned = [p for p in soak.poisons if not 400 <= p[1] < 500]
    verdict = "PASS" if (not failed and slope < args.max_slope and not poisoned and restarts == kills) else "FAIL"
    result = {
        "requests": len(soak.records), "failed": len(failed), "errors": sorted({r.error for r in failed})[:10],
        "faults": [{"at_s": round(t - soak.started, 1), "kind": k, "rank": r} for t, k, r in soak.faults],
        "migrated": moved, "in_flight_at_a_fault": len(hit),
        "poisons": {kind: [status for k, status, _ in soak.poisons if k == kind] for kind in POISONS},
        "poisons_not_4xx": [list(p) for p in poisoned], "engine_restarts": restarts, "engine_kills": kills,
        "latency_s": {"calm_p50": pct(calm, 0.5), "calm_p99": pct(calm, 0.99),
                      "faulted_p50": pct(hit_s, 0.5), "faulted_p99": pct(hit_s, 0.99)},
        "added_latency_p50_s": pct(hit_s, 0.5) - pct(calm, 0.5),
        "calm_max_gap_p99_s": calm_gap, "paused_at_a_fault": len(paused),
        "pause_s": {"p50": pct(paused, 0.5), "max": max(paused, default=float("nan"))}, "by_kind": by_kind,
        "api_rss_mib": {"first": soak.rss[0][1] if soak.rss else None, "last": soak.rss[-1][1] if soak.rss else None,
                        "slope_second_half_mib_per_min": slope},
        "verdict": verdict,
    }
    print(f"\n| requests | failed | faults | migrated | in flight at a fault | P50 calm / faulted (s) "
          f"| P99 calm / faulted (s) | API RSS slope (MiB/min) | verdict |\n"
          f"|---:|---:|---:|---:|---:|---|---|---:|---|\n"
          f"| {len(soak.records)} | {len(failed)} | {len(soak.faults)} | {moved:.0f} | {len(hit)} "
          f"| {pct(calm, 0.5):.2f} / {pct(hit_s, 0.5):.2f} | {pct(calm, 0.99):.2f} / {pct(hit_s, 0.99):.2f} "
          f"| {slope:.2f} | {verdict} |")
    print(f"poisons: {len(soak.poisons)} ({', '.join(f'{k} {len(v)}' for k, v in result['poisons'].items())}), "
          f"not a 4xx: {len(poisoned)}; engine restarts {restarts} against kills {kills}")
    print(f"streams paused at a fault: {len(paused)}, pause P50 {pct(paused, 0.5):.2f} s, max "
          f"{max(paused, default=float('nan')):.2f} s (calm streams' longest gap, P99: {calm_gap:.2f} s)")
    for kind, row in by_kind.items():
        print(f"  {kind}: {row['faults']} faults, {row['paused_streams']} streams paused, "
              f"P50 {row['pause_p50_s']:.2f} s, max {row['pause_max_s']:.2f} s")
    for error in result["errors"]:
        print(f"  failed: {error}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(model=args.model, duration_s=args.duration_s,
                                                  concurrency=args.concurrency), "result": result}, indent=1))
    print(f"wrote {args.out}")
    sys.exit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
