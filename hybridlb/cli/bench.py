"""``hybridlb bench …``: benchmark clients (``hybridlb.bench``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridlb.cli.options import fail

bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Benchmark clients.")


@bench_app.command("serve")
def bench_serve_command(
    base_url: Annotated[str, typer.Option(help="Server root, e.g. http://127.0.0.1:8000.")] = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="Model name (default: the server's first).")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="Local model or tokenizer dir (default: --model if one, else the server's own tokenizer).")] = None,
    dataset_name: Annotated[str, typer.Option(help="Only 'random' for now.")] = "random",
    random_input_len: Annotated[int, typer.Option(min=1)] = 1024,
    random_output_len: Annotated[int, typer.Option(min=1)] = 128,
    num_prompts: Annotated[int, typer.Option(min=1)] = 1000,
    max_concurrency: Annotated[int | None, typer.Option(min=1)] = None,
    request_rate: Annotated[float, typer.Option(help="Requests/s (Poisson); inf sends all at once.")] = float("inf"),
    ignore_eos: Annotated[bool, typer.Option()] = False,
    seed: Annotated[int, typer.Option()] = 0,
    prompt_format: Annotated[str, typer.Option(help="ids (token-id prompts) or text.")] = "ids",
    api_key: Annotated[str | None, typer.Option(envvar=["HYBRIDLB_API_KEY", "OPENAI_API_KEY"],
                                                help="The server's API key.")] = None,
    save_result: Annotated[Path | None, typer.Option(help="Write the results as JSON here.")] = None,
):
    """Load an OpenAI-compatible server and print TTFT / TPOT / ITL / throughput."""
    from hybridlb.bench.client import BenchArgs, BenchError, bench_serve

    if dataset_name != "random":
        fail(f"dataset {dataset_name!r} is not supported; use --dataset-name random")
    if prompt_format not in ("ids", "text"):
        fail("--prompt-format must be ids or text")
    args = BenchArgs(
        base_url=base_url.rstrip("/"), model=model, tokenizer=tokenizer, dataset_name=dataset_name,
        random_input_len=random_input_len, random_output_len=random_output_len, num_prompts=num_prompts,
        max_concurrency=max_concurrency, request_rate=request_rate, ignore_eos=ignore_eos, seed=seed,
        prompt_format=prompt_format, api_key=api_key, save_result=str(save_result) if save_result else None,
    )
    try:
        summary = bench_serve(args)
    except BenchError as exc:
        fail(str(exc))
    raise typer.Exit(0 if summary["completed"] else 1)
