"""``hybridlb make-model`` and ``hybridlb generate``: checkpoints and offline generation."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from hybridlb.cli.config_flags import options, overrides
from hybridlb.cli.options import CONFIG, build_config, ensure_checkpoint, fail, with_options
from hybridlb.cli.problems import Problems


def make_model_command(
    out: Annotated[Path, typer.Option(help="Directory to write the checkpoint into.")],
    arch: Annotated[str, typer.Option(help="llama, qwen2, qwen3, qwen3_moe or mixtral.")] = "qwen3",
    size: Annotated[str, typer.Option(help="tiny (tests, seconds on CPU) or small (benchmarks).")] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    max_shard_mb: Annotated[float, typer.Option(help="Split weights into shards of this size (0: one file).")] = 0,
):
    """Write a random-weight Hugging Face checkpoint with a real tokenizer, fully offline."""
    from hybridlb.model.make_model import make_model

    try:
        path = make_model(arch, size, out, seed=seed, max_shard_mb=max_shard_mb or None)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(f"wrote {arch} ({size}) to {path}")


@with_options(options("generate"), into="flags")
def generate(
    prompt: Annotated[list[str], typer.Option(help="Prompt text; repeat for a batch.")],
    config: CONFIG = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 32,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables it.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Per-request sampling seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string; repeatable.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep going past end-of-sequence.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per prompt.")] = False,
    flags: dict[str, Any] | None = None,
):
    """Generate offline, in this process, for one or more prompts."""
    from hybridlb.checkpoint.spec import CheckpointError
    from hybridlb.llm import LLM
    from hybridlb.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=stop or [], ignore_eos=ignore_eos)
    if problems := params.problems():
        fail("; ".join(message for _, message in problems))
    found = Problems()
    cfg = build_config(config, overrides(flags, found), found)
    found.raise_any()
    try:
        ensure_checkpoint(cfg.engine)
        llm = LLM(**cfg.engine.model_dump(exclude={"make_if_missing"}))
        results = llm.generate(prompt, params)
    except (CheckpointError, ValueError, RuntimeError) as exc:
        fail(str(exc))
    for text, result in zip(prompt, results, strict=True):
        if as_json:
            typer.echo(json.dumps({"prompt": text, "text": result.text, "token_ids": result.token_ids,
                                   "finish_reason": result.finish_reason}, ensure_ascii=False))
        else:
            typer.echo(f"{text}\x1b[1m{result.text}\x1b[0m" if sys.stdout.isatty() else text + result.text)
