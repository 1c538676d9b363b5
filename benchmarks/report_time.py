"""The report section of benchmarks/time_accounting.py: where a served token's time goes.
See report_sections.py."""

from __future__ import annotations

import statistics

from report_sections import Page, bars, cell


def _decode_ms(steps: dict) -> float:
    decode = steps.get("decode") or steps.get("decode steps") or {}
    return 1000 * decode["s"] / decode["count"] if decode.get("count") else 0.0


def time_accounting(page: Page, data: dict) -> str:
    meta, rounds = data["meta"], data["rounds"]
    page.text(f"{meta['model']} in {meta['dtype']} (quantization {meta['quantization']}), {meta['shape']}, "
              f"{meta['num_prompts']} prompts, one engine; served and in-process alternating, each alone.")
    page.table(["round", "served tok/s", "in-process tok/s", "served / in-process", "served TPOT ms",
                "decode step ms (served)", "decode step ms (in-process)"],
               [[i + 1, r["served"]["output_tok_s"], r["in_process"]["output_tok_s"], r["served_over_in_process"],
                 r["served"]["mean_tpot_ms"], r["served"]["engine"]["rows"]["decode steps"]["mean_ms"],
                 _decode_ms(r["in_process"]["steps"])] for i, r in enumerate(rounds)])
    ratio = data["served_over_in_process_median"]
    middle = sorted(rounds, key=lambda r: r["served_over_in_process"])[len(rounds) // 2]
    served, wall = middle["served"], middle["served"]["wall_s"]
    engine = served["engine"]
    page.text(f"**The engine's loop** over the median round's served run ({wall:.1f} s of client wall time; the loop's "
              f"own clock: {engine['loop_window_s']:.1f} s, of which {engine['idle_outside_run_s']:.1f} s idle "
              f"outside the run; accounted {engine['accounted_s'] / wall:.1%} of the wall time):")
    page.table(["where", "seconds", "share of wall", "steps", "positions", "mean ms"],
               [[name, row["s"], row["s"] / wall, row.get("count", ""), row.get("tokens", ""), row.get("mean_ms", "")]
                for name, row in engine["rows"].items()])
    machine, tokens = served["machine"], served["output_tokens"]
    page.text(f"**CPU by process** ({tokens} output tokens; with the machine's idle CPU they account for "
              f"{machine['accounted_cpu_s'] / (machine['cores'] * wall):.1%} of {machine['cores']} cores x wall):")
    page.table(["process", "CPU s", "CPU ms per output token", "voluntary switches", "involuntary switches"],
               [[role, p["cpu_s"], p["ms_per_output_token"], p["voluntary"], p["involuntary"]]
                for role, p in served["processes"].items()] + [["(idle CPU)", machine["idle_cpu_s"], "", "", ""]])
    profiled = data.get("profiled")
    if profiled:
        profile = profiled["api_server_profile"]
        total = sum(profile.values()) or 1
        page.text(f"**The profiled run** (py-spy on the API server, a per-thread core sampler; "
                  f"{profiled['output_tok_s']:.0f} tok/s, not in the ratios): the API server's CPU by what it did "
                  f"({total} samples):")
        page.table(["API server work", "share of its samples"],
                   [[name, n / total] for name, n in sorted(profile.items(), key=lambda kv: -kv[1])])
        page.table(["process/thread", "CPU ticks on each core"],
                   [[name, ", ".join(f"core {core}: {n}" for core, n in cores.items())]
                    for name, cores in profiled["cores_by_thread"].items()])
    name = "".join(c if c.isalnum() else "_" for c in meta["model"].lower())
    page.figure(f"time_accounting_{name}", "served vs in-process output tok/s", lambda ax: bars(
        ax, ["served", "in-process"],
        {"median": [statistics.median(r["served"]["output_tok_s"] for r in rounds),
                    statistics.median(r["in_process"]["output_tok_s"] for r in rounds)]}, "output tok/s"))
    return (f"served/in-process {ratio:.2f} at {meta['shape']} ({meta['dtype']}); decode step "
            f"{cell(served['engine']['rows']['decode steps']['mean_ms'])} ms served vs "
            f"{cell(_decode_ms(middle['in_process']['steps']))} ms in-process")
