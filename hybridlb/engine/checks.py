"""What an engine checks of a request before it queues it, whoever sent it (an API server
checks the same first; an engine may be reached by several, or by a client of its own).
Everything a request carries that a step will index or load is checked here, so that a step
fails only for faults nobody could see coming (``hybridlb.engine.blame``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridlb.params import LoRARequest, SamplingParams

if TYPE_CHECKING:
    from hybridlb.config import EngineConfig


def request_problem(prompt: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                    has_model: bool) -> str | None:
    """Why the engine cannot take a request with this prompt (its output so far included) and
    these params, or None. ``has_model``: False for a simulated engine."""
    if not prompt:
        return "the prompt is empty"
    if len(prompt) >= max_model_len:
        return f"the prompt has {len(prompt)} tokens but max_model_len is {max_model_len}; shorten the prompt"
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        return f"prompt token ids must be in [0, {vocab_size})"
    if (problem := params.out_of_vocab(vocab_size)) is not None:
        return problem[1]
    if problems := params.problems():
        return "; ".join(message for _, message in problems)
    if (params.logprobs is not None or params.prompt_logprobs is not None) and not has_model:
        return "this engine has no model (engine.simulate), so it has no log-probabilities; drop logprobs"
    if params.constraint is not None and not has_model:
        return "this engine has no model (engine.simulate), so it cannot follow a grammar; drop the constraint"
    return None


def adapter_problem(config: EngineConfig, runner, lora: LoRARequest | None) -> str | None:
    """Why a request's LoRA adapter cannot be served here, or None. ``runner.check_lora`` reads it
    (then kept in memory); any failure to (a file replaced or truncated since it was registered) is
    the request's error, never the engine's."""
    if lora is None:
        return None
    if config.lora is None:
        return f"this engine serves no LoRA adapters (engine.lora is unset); {lora.name!r} needs --enable-lora"
    from hybridlb.checkpoint.lora import AdapterError

    try:
        runner.check_lora(lora)
    except AdapterError as exc:
        return f"LoRA adapter {lora.name!r}: {exc}"
    except Exception as exc:
        return f"LoRA adapter {lora.name!r} cannot be read: {type(exc).__name__}: {exc}"
    return None
