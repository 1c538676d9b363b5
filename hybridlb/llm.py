"""Offline batch API: ``LLM(model_dir).generate(prompts, params)`` in this process."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridlb import lifecycle
from hybridlb.checkpoint.detokenizer import IncrementalDetokenizer, visible
from hybridlb.checkpoint.hub import names_hub_model
from hybridlb.checkpoint.path import resolve
from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.config import EngineConfig
from hybridlb.engine.core import make_core
from hybridlb.grammar import check
from hybridlb.params import SamplingParams
from hybridlb.protocol import TokenLogprobs


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # with SamplingParams.logprobs: one per token
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with prompt_logprobs: None first


class LLM:
    """Runs an EngineCore in-process; ``engine_options`` are EngineConfig fields.

    Like the engine process, it tunes this process's allocator (see
    ``lifecycle.tune_allocator``) and, when ``torch_threads`` is set, torch's thread count.
    """

    def __init__(self, model: str, **engine_options):
        lifecycle.tune_allocator()
        if engine_options.get("revision") and names_hub_model(model):  # that snapshot, as the CLI pins it
            model = str(resolve(model, engine_options["revision"]).path)
        self.config = EngineConfig(model=model, **engine_options)
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        self.engine = make_core(self.config)  # engine.simulate: echoes, no model
        self.tokenizer = Tokenizer(model)
        self._next_id = 0

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        live: dict[str, tuple[CompletionOutput, IncrementalDetokenizer]] = {}
        detok_params: dict[str, SamplingParams] = {}
        results = []
        for prompt, p in zip(prompts, params_list, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            result = CompletionOutput(prompt_token_ids=ids)
            request_id = str(self._next_id)
            self._next_id += 1
            if p.constraint is not None:  # a grammar that cannot compile is the caller's error, said now
                check(p.constraint, self.config.structured_outputs)
            error = self.engine.add_request(request_id, ids, p)
            if error is not None:
                self.engine.abort(list(live))
                raise ValueError(f"prompt {len(results)}: {error.error}")
            live[request_id] = (result, IncrementalDetokenizer.for_request(self.tokenizer, ids, p))
            detok_params[request_id] = p
            results.append(result)
        while live:
            for output in self.engine.step():
                result, detok = live[output.request_id]
                result.token_ids += output.new_token_ids
                shown = visible(output.new_token_ids, output.stop_token_id, detok_params[output.request_id])
                text, result.finish_reason = detok.take(shown, output.finish_reason)
                result.text += text
                if output.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + output.logprobs
                if output.prompt_logprobs is not None:
                    result.prompt_logprobs = output.prompt_logprobs
                if detok.stopped:
                    self.engine.abort([output.request_id])
                if result.finish_reason is not None:
                    del live[output.request_id]
        return results
