"""The report sections about the API server: its overhead over the engine's socket
(benchmarks/api_overhead.py) and TTFT as vLLM's client reads it (benchmarks/chat_ttft.py).
See report_sections.py."""

from __future__ import annotations

import statistics

from report_sections import Page, bars, cell


def api_overhead(page: Page, data: dict) -> str:
    o, c = data["overhead"], data["chunk_rate"]
    page.table(["path", "output tok/s per round"],
               [["HTTP + API server", o["http_tok_s"]], ["direct to the engine (ZMQ)", o["direct_tok_s"]]])
    ratio = o.get("ratio_median", o.get("ratio_best"))
    page.text(f"HTTP / direct per round {cell(o.get('ratios', []))}, median **{ratio:.3f}** ({data.get('size', '?')} "
              f"model, concurrency {data.get('concurrency', '?')}). One API server process streamed "
              f"**{c['chunks_per_s']:.0f} chunks/s** at concurrency {c['concurrency']} (tiny model) using "
              f"{c['api_server_cpu']:.0%} of a core.")
    page.figure("api_overhead", "HTTP vs direct output tok/s", lambda ax: bars(
        ax, ["HTTP + API server", "direct (ZMQ)"],
        {"median round": [statistics.median(o["http_tok_s"]), statistics.median(o["direct_tok_s"])]}, "output tok/s"))
    return f"HTTP/direct {ratio:.2f}; {c['chunks_per_s']:.0f} chunks/s per API server"


def chat_ttft(page: Page, data: dict) -> str:
    r = data["result"]
    page.table(["mean TTFT as measured by", "ms", "requests"],
               [["`vllm bench serve --backend openai-chat` (client)", r["client_mean_ttft_ms"], r["requests_client"]],
                ["hybridlb's own histogram (server)", r["server_mean_ttft_ms"], int(r["requests_server"])]])
    page.text(f"Client / server **{r['ratio']:.3f}** (goal: within 1.10); client median TTFT "
              f"{r['client_median_ttft_ms']:.0f} ms, {r['output_tok_s']:.0f} output tok/s.")
    return f"client/server mean TTFT {r['ratio']:.2f} (goal <= 1.10)"
