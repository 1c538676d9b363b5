"""Where one engine step goes: a decode step and a prefill step, profiled.

For any model and batch: torch ops by self time, the share of wall time spent outside
torch ops (Python, scheduling, tensor building), and time per part of the model (embed,
each decoder layer's attention and MLP, final norm, lm_head + sampling) measured with
forward hooks. Default: the real SmolLM2-135M-Instruct, batch 16, 64-token prompts.

The decode step is also timed without the profiler and its hooks, and its work put against
the machine: its matmul FLOPs (2 x batch x every projection's and the LM head's weights) and
attention FLOPs per second, and its bytes (weights plus the KV read) per second, as a
fraction of the decode peak and memory bandwidth that ``machine_peak.py`` measured (read
from ``--peak``, benchmarks/results/machine_peak.json; run that first, nothing else running).

    python benchmarks/step_profile.py [--model M] [--batch 16] [--prompt-len 64] [--dtype bfloat16]
        [--quantization none|gguf|int8|int4]

``--quantization`` defaults to none (a GGUF file dequantized, what the report's figures are); with
another method the ops and parts show the quantized step, but the bytes and FLOPs put against the
machine still count dense weights.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import SMOLLM2, stamp
from torch.profiler import ProfilerActivity, profile

from hybridlb import LLM, SamplingParams


class PartTimer:
    """Wall time per model part, from forward pre/post hooks (parts run one after another)."""

    def __init__(self, model: torch.nn.Module):
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[str, float] = {}
        self.handles = []
        self._hook(model.embed, "embed")
        self._hook(model.norm, "final norm")
        self._hook(model.lm_head, "lm_head")
        for layer in model.layers:
            self._hook(layer.self_attn, "attention (all layers)")
            self._hook(layer.mlp, "mlp (all layers)")
            self._hook(layer.input_norm, "norms (all layers)")
            self._hook(layer.post_attn_norm, "norms (all layers)")

    def _hook(self, module: torch.nn.Module, name: str) -> None:
        def before(*_):
            self._started[name] = time.perf_counter()

        def after(*_):
            self.seconds[name] += time.perf_counter() - self._started.pop(name)

        self.handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def profile_steps(llm: LLM, steps: int) -> dict:
    """Profiled eagerly: the decode program (model/decode_program.py) runs a step as one C call, which
    neither the hooks nor torch's profiler see into."""
    core = llm.engine
    program, core.runner.program = core.runner.program, None
    timer = PartTimer(core.runner.model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        wall = time.perf_counter() - start
    timer.remove()
    core.runner.program = program
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    inside = sum(e.self_cpu_time_total for e in events) / 1e6
    ops = [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps,
            "share": e.self_cpu_time_total / 1e6 / wall} for e in events[:15]]
    parts = {name: 1000 * s / steps for name, s in timer.seconds.items()}
    return {"step_ms": 1000 * wall / steps, "outside_torch_share": max(0.0, 1 - inside / wall), "ops": ops,
            "parts_ms": parts}


def timed_steps(llm: LLM, steps: int, eager: bool = False) -> float:
    """Milliseconds per engine step, no profiler or hooks; decode steps as the decode program unless
    ``eager`` (or the model is not covered)."""
    runner = llm.engine.runner
    program, runner.program = runner.program, None if eager else runner.program
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    runner.program = program
    return 1000 * (time.perf_counter() - start) / steps


def decode_work(llm: LLM, batch: int, context: int) -> dict:
    """A decode step's FLOPs and bytes at ``batch`` sequences of ``context`` tokens."""
    model = llm.engine.runner.model
    spec = model.spec
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = spec.hidden_size * (q + 2 * kv) + q * spec.hidden_size + 3 * spec.hidden_size * spec.intermediate_size
    weights = spec.num_layers * per_layer + spec.vocab_size * spec.hidden_size  # LM head; the embedding is a lookup
    itemsize = llm.engine.runner.dtype.itemsize
    return {"matmul_flops": 2 * batch * weights,
            "attention_flops": 4 * batch * spec.num_layers * spec.num_heads * spec.head_dim * context,
            "weight_bytes": weights * itemsize, "kv_bytes": 2 * batch * spec.num_layers * kv * context * itemsize}


def against_peak(work: dict, step_ms: float, batch: int, dtype: str, peak_path: Path) -> dict:
    seconds = step_ms / 1000
    result = {"matmul_gflop_s": work["matmul_flops"] / seconds / 1e9,
              "gflop_s": (work["matmul_flops"] + work["attention_flops"]) / seconds / 1e9,
              "gb_s": (work["weight_bytes"] + work["kv_bytes"]) / seconds / 1e9}
    if not peak_path.exists():
        print(f"no {peak_path}: run benchmarks/machine_peak.py first for the fractions of the machine's peak")
        return result
    peak = json.loads(peak_path.read_text())
    by_batch = peak["decode_peak"].get(dtype, {})
    if str(batch) in by_batch:
        result |= {"decode_peak_gflop_s": by_batch[str(batch)],
                   "matmul_fraction_of_peak": result["matmul_gflop_s"] / by_batch[str(batch)]}
    result |= {"copy_gb_s": peak["copy_gb_s"], "fraction_of_copy_bandwidth": result["gb_s"] / peak["copy_gb_s"],
               "peak_measured": peak["meta"]["date"]}
    if "read_gb_s" in peak:  # weights are only read: the read bandwidth is their bound
        result |= {"read_gb_s": peak["read_gb_s"], "fraction_of_read_bandwidth": result["gb_s"] / peak["read_gb_s"]}
    return result


def start_requests(llm: LLM, batch: int, prompt_len: int, max_tokens: int, prefix: str) -> list[str]:
    rng = random.Random(prefix)  # warm-up and measured prompts differ: no prefix-cache hits
    vocab = llm.engine.vocab_size
    ids = [f"{prefix}{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for request_id in ids:
        llm.engine.add_request(request_id, [rng.randrange(3, vocab) for _ in range(prompt_len)], params)
    return ids


def print_profile(title: str, result: dict) -> None:
    print(f"\n{title}: {result['step_ms']:.1f} ms per step, {result['outside_torch_share']:.0%} outside torch ops")
    for name, ms in sorted(result["parts_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:<26} {ms:8.2f} ms")
    print(f"  {'op':<48} {'ms/step':>8} {'calls':>7} {'share':>6}")
    for op in result["ops"]:
        print(f"  {op['op'][:48]:<48} {op['self_ms_per_step']:>8.2f} {op['calls_per_step']:>7.0f} {op['share']:>6.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", choices=["none", "gguf", "int8", "int4"])
    parser.add_argument("--peak", type=Path, default=Path("benchmarks/results/machine_peak.json"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_profile.json"))
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=2048, kv_cache_gib=0.5, dtype=args.dtype, quantization=args.quantization,
              max_num_batched_tokens=max(2048, args.batch * args.prompt_len))
    warm = start_requests(llm, args.batch, args.prompt_len, 4, "warm")
    while llm.engine.scheduler.waiting or llm.engine.scheduler.running:
        llm.engine.step()
    llm.engine.abort(warm)
    start_requests(llm, args.batch, args.prompt_len, args.steps * 5, "p")
    prefill = profile_steps(llm, 1)  # one step prefills the whole batch (budget allows it)
    decode = profile_steps(llm, args.steps)
    decode["step_ms_unprofiled"] = timed_steps(llm, args.steps)
    decode["step_ms_eager"] = timed_steps(llm, args.steps, eager=True)
    decode["decode_program"] = llm.engine.runner.program is not None
    dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
    context = args.prompt_len + 3 * args.steps // 2  # the middle of the unprofiled steps
    decode["work"] = decode_work(llm, args.batch, context)
    decode["machine"] = against_peak(decode["work"], decode["step_ms_unprofiled"], args.batch, dtype, args.peak)
    print(f"model {args.model}, dtype {llm.engine.runner.dtype}, batch {args.batch}, prompt {args.prompt_len}, "
          f"threads {torch.get_num_threads()}")
    print_profile(f"prefill ({args.batch} x {args.prompt_len} tokens)", prefill)
    print_profile(f"decode (batch {args.batch})", decode)
    machine = decode["machine"]
    print(f"\ndecode without the profiler: {decode['step_ms_unprofiled']:.1f} ms per step "
          f"({'decode program' if decode['decode_program'] else 'eager'}; eager {decode['step_ms_eager']:.1f} ms), "
          f"{args.batch / decode['step_ms_unprofiled'] * 1000:.0f} tok/s; matmuls {machine['matmul_gflop_s']:.0f} "
          f"GFLOP/s, weights + KV {machine['gb_s']:.1f} GB/s")
    if "matmul_fraction_of_peak" in machine:
        print(f"  {machine['matmul_fraction_of_peak']:.0%} of the machine's decode peak at batch {args.batch} "
              f"({machine['decode_peak_gflop_s']:.0f} GFLOP/s, machine_peak.py)")
    if "fraction_of_copy_bandwidth" in machine:
        print(f"  {machine['fraction_of_copy_bandwidth']:.0%} of the memory copy bandwidth "
              f"({machine['copy_gb_s']:.1f} GB/s)")
    if "fraction_of_read_bandwidth" in machine:
        print(f"  {machine['fraction_of_read_bandwidth']:.0%} of the memory read bandwidth "
              f"({machine['read_gb_s']:.1f} GB/s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(model=args.model, batch=args.batch, prompt_len=args.prompt_len,
                                                  dtype=str(llm.engine.runner.dtype)),
                                    "prefill": prefill, "decode": decode}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
