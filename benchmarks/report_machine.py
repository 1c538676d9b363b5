"""REPORT.md's sections on the machine's own limits (benchmarks/machine_peak.py) and where an
engine step goes against them (benchmarks/step_profile.py)."""

from __future__ import annotations

from report_sections import Page, bars


def machine_peak(page: Page, data: dict) -> str:
    passes = data["model_passes"]
    page.text("A model pass: every projection of SmolLM2-135M's 30 layers plus the LM head, fresh weights each "
              "(nothing stays in cache between layers), at the batch of a decode step. The fastest path's GFLOP/s "
              "at a batch is the **decode peak** a step's matmuls can reach (int8.c and int4.c, which read fewer "
              "bytes, left out). The engine's bfloat16 layers run `hybridlb bf16.c` where the CPU has AVX-512 "
              "BF16, else oneDNN packed; `--quantization int8` runs `hybridlb int8.c` (AVX-512 VNNI), `int4` "
              "and `gguf` run `hybridlb int4.c` in bfloat16 engines (AVX-512 BF16).")
    page.table(["dtype", "path", "batch", "pass ms", "GFLOP/s", "weights GB/s", "tok/s bound"],
               [[p["dtype"], p["path"], p["batch"], p["step_ms"], p["gflop_s"], p["gb_s"], p["tokens_per_s_bound"]]
                for p in passes])
    page.text("Single GEMMs, the weight in cache after the first run (so small weights read faster than in a "
              "model pass):")
    page.table(["dtype", "path", "M×N×K", "GFLOP/s"],
               [[g["dtype"], g["path"], f"{g['m']}×{g['n']}×{g['k']} ({g['projection']})", g["gflop_s"]]
                for g in data["gemm"] if g["batch"] in (1, 64, 2048)])
    read = f"; read (256 MiB summed): **{data['read_gb_s']:.1f} GB/s**" if "read_gb_s" in data else ""
    page.text(f"Memory copy (256 MiB, read + write): **{data['copy_gb_s']:.1f} GB/s**{read}.")
    peaks = data["decode_peak"]

    def draw(ax):
        batches = list(peaks["bfloat16"])
        bars(ax, [f"batch {b}" for b in batches],
             {dtype: [by_batch[b] for b in batches] for dtype, by_batch in peaks.items()}, "decode peak GFLOP/s")

    page.figure("machine_peak", "decode peak GFLOP/s by batch and dtype", draw)
    bf16 = peaks["bfloat16"]
    one = min((p for p in passes if p["dtype"] == "bfloat16" and p["batch"] == 1 and "int" not in p["path"]),
              key=lambda p: p["step_ms"])
    return (f"bf16 decode peak {bf16['16']:.0f} / {bf16['64']:.0f} GFLOP/s at batch 16 / 64; batch-1 weights "
            f"{one['gb_s']:.1f} GB/s (≤ {one['tokens_per_s_bound']:.0f} tok/s); copy {data['copy_gb_s']:.1f} GB/s")


def step_profile(page: Page, data: dict) -> str:
    meta, decode, prefill = data["meta"], data["decode"], data["prefill"]
    machine, work = decode["machine"], decode["work"]
    batch = meta["batch"]
    page.text(f"{meta['model']} ({meta['dtype']}), batch {batch}, {meta['prompt_len']}-token prompts. Without the "
              f"profiler a decode step takes **{decode['step_ms_unprofiled']:.1f} ms** "
              f"({batch / decode['step_ms_unprofiled'] * 1000:.0f} tok/s).")
    rows = [["matmul GFLOP/s", machine["matmul_gflop_s"]],
            ["matmul + attention GFLOP/s", machine["gflop_s"]],
            ["weights + KV read, GB/s", machine["gb_s"]],
            ["matmul FLOPs per step (G)", work["matmul_flops"] / 1e9],
            ["KV read per step (MB)", work["kv_bytes"] / 1e6]]
    if "matmul_fraction_of_peak" in machine:
        rows += [[f"decode peak at batch {batch} (machine_peak.py, {machine['peak_measured'][:10]})",
                  machine["decode_peak_gflop_s"]],
                 ["**matmuls as a fraction of the decode peak**", f"**{machine['matmul_fraction_of_peak']:.0%}**"],
                 ["bytes as a fraction of the memory copy bandwidth", f"{machine['fraction_of_copy_bandwidth']:.0%}"]]
        if "fraction_of_read_bandwidth" in machine:
            rows.append(["bytes as a fraction of the memory read bandwidth",
                         f"{machine['fraction_of_read_bandwidth']:.0%}"])
    page.table(["decode step", "value"], rows)
    for title, result in ((f"Decode (batch {batch})", decode), (f"Prefill ({batch} × {meta['prompt_len']})", prefill)):
        page.text(f"{title}, under the profiler: {result['step_ms']:.1f} ms per step, "
                  f"{result['outside_torch_share']:.0%} outside torch ops (the C kernels, Python).")
        page.table(["part", "ms per step"], sorted(([k, v] for k, v in result["parts_ms"].items()),
                                                   key=lambda kv: -kv[1]))
    if "matmul_fraction_of_peak" not in machine:
        return f"decode batch {batch}: {decode['step_ms_unprofiled']:.1f} ms per step"
    return (f"decode batch {batch}: {decode['step_ms_unprofiled']:.1f} ms per step, matmuls "
            f"{machine['matmul_fraction_of_peak']:.0%} of the machine's decode peak")
