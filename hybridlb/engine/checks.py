"""What an engine checks of a request before it queues it, whoever sent it (an API server
checks the same first; an engine may be reached by several, or by a client of its own).
Everything a request carries that a step will index or load is checked here, so that a step
fails only for faults nobody could see coming (``hybridlb.engine.blame``). A request's LoRA
adapter is checked, and read, by ``hybridlb.engine.lora``."""

from __future__ import annotations

from hybridlb.params import SamplingParams


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
