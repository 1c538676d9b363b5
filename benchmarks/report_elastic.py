"""The report section of benchmarks/elastic.py: a step load against an autoscaled node, fixed DP=1
and DP=2, and explicit resizes under load. See report_sections.py."""

from __future__ import annotations

import statistics

from report_sections import Page, bars

SETUPS = ("fixed DP=1", "fixed DP=2", "autoscaled 1..2")
FIGURES = (("output_tok_s", "output tok/s"), ("p50_ttft_ms", "TTFT P50 ms"), ("p99_ttft_ms", "TTFT P99 ms"),
           ("rank_s", "rank-seconds"))


def _median(rounds: list[dict], setup: str, key: str) -> float | None:
    values = [r[setup][key] for r in rounds if r.get(setup, {}).get(key) is not None]
    return statistics.median(values) if values else None


def elastic(page: Page, data: dict) -> str:
    meta, rounds = data["meta"], data["rounds"]
    page.text(f"{meta['model']} {meta['dtype']}, one node; the step load: idle, {meta['concurrency']} closed-loop "
              f"streams (32 prompt words, 64 output tokens) for {meta['load_s']:g} s, idle {meta['tail_s']:g} s. "
              f"Each server alone, rounds alternating the order; medians of {len(rounds)} rounds. Autoscaled: "
              f"`{meta['autoscaling']}`.")
    anchor = {key: _median(rounds, "fixed DP=2", key) for key, _ in FIGURES}
    rows = []
    for setup in SETUPS:
        figures = [_median(rounds, setup, key) for key, _ in FIGURES]
        failed = sum(r[setup]["failed"] for r in rounds)
        rows.append([setup, *figures, figures[2] / anchor["p99_ttft_ms"], figures[3] / anchor["rank_s"], failed])
    page.table(["server", *(label for _, label in FIGURES), "P99 vs fixed DP=2", "rank-s vs fixed DP=2",
                "failed (all rounds)"], rows)
    page.table(["round", *(f"{setup} tok/s" for setup in SETUPS), *(f"{setup} P99 ms" for setup in SETUPS)],
               [[i + 1, *(r[s]["output_tok_s"] for s in SETUPS), *(r[s]["p99_ttft_ms"] for s in SETUPS)]
                for i, r in enumerate(rounds)])
    scaled = "autoscaled 1..2"
    grown = _median(rounds, scaled, "grown_after_load_s")
    served = _median(rounds, scaled, "first_token_after_load_s")
    shrunk = _median(rounds, scaled, "shrunk_after_load_end_s")
    page.text(f"**The autoscaler** (the load's start to: rank 2 in the balancer, rank 1's first token; the load's "
              f"end to the node back at one rank; medians): grown after {grown:.1f} s, serving after {served:.1f} s, "
              f"shrunk {shrunk:.1f} s after the load ended. Its decision waits `upscale_delay_s` (2 s) of wanting "
              "more at the once-a-second check, then the new engine loads the model.")
    resize = [r["resize"] for r in rounds]
    page.text("**Explicit resizes under the same streams** (`POST /scale_elastic_ep` on a DP=1 node: 1 → 2, then "
              "2 → 1 with `drain_timeout` 30):")
    page.table(["round", "grow: answered s", "grow: rank 1's first token s", "shrink: drained s", "requests",
                "failed"],
               [[i + 1, r["grow_answer_s"], r["grow_first_token_s"], r["shrink_drain_s"], r["requests"], r["failed"]]
                for i, r in enumerate(resize)])
    page.figure("elastic", "step load: TTFT P99 and rank-seconds", lambda ax: bars(
        ax, list(SETUPS), {"TTFT P99 / fixed DP=2": [row[5] for row in rows],
                           "rank-s / fixed DP=2": [row[6] for row in rows]}, "ratio to fixed DP=2"))
    first_token = statistics.median(r["grow_first_token_s"] for r in resize)
    failed = sum(row[-1] for row in rows) + sum(r["failed"] for r in resize)
    return (f"autoscaled: TTFT P99 {rows[2][5]:.2f}x fixed DP=2 at {rows[2][6]:.2f}x its rank-seconds; a grown rank "
            f"serves {first_token:.1f} s after the request; {failed} failed")
