"""Between hybridlb's request and output types and vLLM's: finish reasons, eos, structured
outputs, logprobs."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from hybridlb.protocol import TokenLogprobs

if TYPE_CHECKING:
    from hybridlb.params import Constraint, SamplingParams

FINISH = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "stop"}  # vLLM's FinishReason values (4: repetition)


def primary_eos(path: str, eos_ids: list[int]) -> int | None:
    """The tokenizer's own eos (vLLM's primary; generation_config's others stop as stop ids)."""
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    token = config.get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    vocab = _read_json(os.path.join(path, "tokenizer.json")).get("added_tokens", [])
    for added in vocab:
        if added.get("content") == token:
            return added.get("id")
    return eos_ids[0] if eos_ids else None


def _read_json(path: str) -> dict:
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {}


def unsupported(params: SamplingParams) -> str | None:
    if params.constraint is not None and (params.constraint.after or params.constraint.opener):
        return ("structured outputs after a reasoning model's thinking are not supported with --engine-backend vllm "
                "yet; ask without a reasoning parser, or serve with the hybridlb engine")
    return None


def structured(constraint: Constraint):
    from vllm.sampling_params import StructuredOutputsParams

    value = constraint.value
    kind = {"json": {"json": value}, "regex": {"regex": value}, "choice": {"choice": json.loads(value)},
            "grammar": {"grammar": value}, "structural_tag": {"structural_tag": value}}[constraint.kind]
    return StructuredOutputsParams(**kind, disable_any_whitespace=bool(constraint.compact),
                                   disable_additional_properties=bool(constraint.closed))


def logprobs(lists) -> list[TokenLogprobs] | None:
    """vLLM's LogprobsLists (column 0: the sampled token; then the top k) as hybridlb's."""
    if lists is None:
        return None
    return [TokenLogprobs(int(ids[0]), float(values[0]), [int(i) for i in ids[1:]], [float(v) for v in values[1:]])
            for ids, values in zip(lists.logprob_token_ids.tolist(), lists.logprobs.tolist(), strict=True)]


def prompt_logprobs(rows_in: list) -> list[TokenLogprobs | None]:
    """The prompt's rows, over every prefill chunk (``rows_in``: vLLM's LogprobsTensors): None for the
    first token, which has no context."""
    rows: list[TokenLogprobs | None] = [None]
    for tensors in rows_in:
        for ids, values in zip(tensors.logprob_token_ids.tolist(), tensors.logprobs.tolist(), strict=True):
            rows.append(TokenLogprobs(int(ids[0]), float(values[0]), [int(i) for i in ids[1:]],
                                      [float(v) for v in values[1:]]))
    return rows
