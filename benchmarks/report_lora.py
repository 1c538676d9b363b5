"""REPORT.md's section on LoRA adapters (benchmarks/lora.py)."""

from __future__ import annotations

from report_bandwidth import rounds
from report_sections import Page, bars


def lora(page: Page, data: dict) -> str:
    meta = data.get("meta", {})
    summary = []
    page.text(f"{meta.get('rounds', '?')} rounds, each server alone on the machine, the order reversing every other "
              "round; medians, each round's figure in brackets. Random adapters of rank "
              f"{meta.get('rank', '?')} on all seven projections; 32 random token ids in, 64 out, concurrency 16.")
    if "mix" in data:
        rows, ratios = data["mix"]["rows"], data["mix"]["ratios"]
        page.text("**Adapters in one batch** (one engine; `+lora`: `--enable-lora --max-loras 8`, requests spread "
                  "over the adapters; × is against the same server's base model without LoRA):")
        table = []
        for r in rows:
            ratio = ratios.get(r["server"], {}).get(r["workload"])
            table.append([r["server"], r["workload"],
                          f"{r['output_tok_s']:.0f} ({rounds(r['output_tok_s_rounds'])})",
                          f"{ratio:.2f}×" if ratio else "1.00×", r["mean_tpot_ms"], r["failed"]])
        page.table(["server", "workload", "output tok/s (rounds)", "× base without LoRA", "TPOT ms", "failed"],
                   table)
        for server, by in ratios.items():
            summary.append(f"{server}: 4 adapters {by['4 adapters']:.2f}× base")

        def draw(ax):
            workloads = list(next(iter(ratios.values())))
            bars(ax, workloads, {s: [ratios[s][w] for w in workloads] for s in ratios}, "× base model without LoRA")

        page.figure("lora_mix", "throughput with adapters in the batch, against the base model", draw, 1)
        _made_by(page, data["mix"])
    if "routing" in data:
        routing = data["routing"]
        page.text(f"**Adapter-aware routing** (DP=2, `--max-loras 2` per rank, {routing.get('adapters', 6)} adapters "
                  "drawn at random per request, 128 requests after a warm-up; loads: adapters placed into a slot "
                  "during the run):")
        page.table(["policy", "output tok/s (rounds)", "TPOT ms", "adapter loads (rounds)", "failed"],
                   [[r["policy"], f"{r['output_tok_s']:.0f} ({rounds(r['output_tok_s_rounds'])})", r["mean_tpot_ms"],
                     f"{r['adapter_loads']:.0f} ({rounds(r['adapter_loads_rounds'])})", r["failed"]]
                    for r in routing["rows"]])
        _made_by(page, routing)
        summary.append(f"adapter-aware routing {routing['ratio']:.2f}× least-loaded")
    return "; ".join(summary)


def _made_by(page: Page, part: dict) -> None:
    """The command and date of the run that measured one part (``--only`` runs them apart)."""
    if "meta" in part:
        page.text(f"Measured by `{part['meta']['command']}` on {part['meta']['date'][:16].replace('T', ' ')}.")
