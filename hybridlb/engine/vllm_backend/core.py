"""``VllmCore``: one rank's engine, vLLM's in-process engine core behind the surface the engine
process shell drives (``hybridlb.engine.core.EngineCore``'s)."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from hybridlb import lifecycle
from hybridlb.checkpoint.path import resolve
from hybridlb.checkpoint.tokenizer import read_eos_token_ids
from hybridlb.config import EngineConfig
from hybridlb.engine import checks
from hybridlb.engine.block_manager import Removed, Stored
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.errors import SickEngine
from hybridlb.engine.step_clock import StepClock
from hybridlb.engine.vllm_backend.args import checked_binding, engine_args, thread_binding
from hybridlb.engine.vllm_backend.convert import (
    FINISH,
    logprobs,
    primary_eos,
    prompt_logprobs,
    structured,
    unsupported,
)
from hybridlb.engine.vllm_backend.events import CacheEvents
from hybridlb.engine.vllm_backend.install import require_vllm
from hybridlb.prefix_hash import adapter_seed, hash_seed
from hybridlb.protocol import EngineReady, EngineStats, RequestOutput

if TYPE_CHECKING:
    from hybridlb.params import LoRARequest, SamplingParams

log = logging.getLogger(__name__)


def warm_logprobs_ranks(vocab_size: int, device: str) -> float:
    """Compile vLLM's helper that ranks a sampled token among its logprobs (torch.compile even when
    the model runs eager) before the rank says it is ready: on its first use it compiles inside a
    step, 2-10 s of a silent engine on 2 CPU cores, and the API server would call the rank stuck and
    move the first request that asks for logprobs. Called as vLLM's sampler calls it (the batch
    dimension unbacked, under inference mode), so the compiled graph is the one a step reuses. Seconds it took."""
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    started = time.perf_counter()
    with torch.inference_mode():  # as a step runs: grad mode is part of what the compiled graph guards
        logprobs, chosen = torch.zeros(2, vocab_size, device=device), torch.zeros(2, 1, device=device)
        torch._dynamo.decorators.mark_unbacked(logprobs, 0)
        torch._dynamo.decorators.mark_unbacked(chosen, 0)
        batched_count_greater_than(logprobs, chosen)
    return time.perf_counter() - started


class VllmCore:
    """One rank's engine: vLLM's in-process engine core behind EngineCore's surface."""

    def __init__(self, config: EngineConfig, dp: DPContext | None = None):
        self.config = config
        self.dp = dp or DPContext()
        self.rank = self.dp.rank
        self.version = require_vllm()
        self.live: dict[str, _Live] = {}
        self.adapter_ids: dict[str, int] = {}
        self.adapter_seeds: dict[str, int] = {}  # adapter name -> its blocks' hash seed (prefix_hash.adapter_seed)
        import torch

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the core runs in this process, stepped by the shell
        if config.device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
            checked_binding(os.environ["VLLM_CPU_OMP_THREADS_BIND"])  # the user's: every rank of the node gets it
        elif config.device == "cpu":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(self.rank, torch.get_num_threads())
        from vllm.v1.engine.core import EngineCore as VllmEngineCore
        from vllm.v1.executor import Executor

        self.path = str(resolve(config.model, config.revision).path)
        vllm_config = engine_args(config, self.path).create_engine_config()
        started = time.perf_counter()
        self.core = VllmEngineCore(vllm_config, Executor.get_class(vllm_config), log_stats=True)
        # A step may compile the model for a shape it has not seen (torch.compile, unless eager): as
        # long as the start's own compile took. The API server waits 3x the longest step an engine
        # says it may take before it calls the engine stuck (a dead one it sees at once).
        compiled = vllm_config.compilation_config.mode not in (None, 0) and not vllm_config.model_config.enforce_eager
        self.compile_s = round(time.perf_counter() - started, 3) if compiled else 0.0
        self.clock = StepClock(vllm_config.scheduler_config.max_num_batched_tokens)
        self.cache_events = None
        if config.prefix_caching and vllm_config.kv_events_config is not None:
            self.cache_events = CacheEvents(hash_seed(config.model), self.adapter_seeds)
            self.core.scheduler.kv_event_publisher = self.cache_events  # vLLM's scheduler hands its events here
        self.model_config = vllm_config.model_config
        self.max_model_len = self.model_config.max_model_len
        self.vocab_size = self.model_config.get_vocab_size()
        self.warm_s = warm_logprobs_ranks(self.vocab_size, config.device)
        self.block_size_ = vllm_config.cache_config.block_size
        self.num_blocks = vllm_config.cache_config.num_gpu_blocks or 0
        self.eos_token_ids = read_eos_token_ids(config.model)
        self.primary_eos = primary_eos(self.path, self.eos_token_ids)
        self.num_steps = self.step_failures = self.failed_in_a_row = 0
        self.busy_s = 0.0
        self.prefix_queries = self.prefix_hits = self.preemptions = 0
        self._rss = (0.0, 0.0)

    # -- requests in ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resumed: list[int] | None = None) -> RequestOutput | None:
        """Queue a request; on invalid input return its error output instead. ``resumed``: the
        output a migrated request already has, computed here as part of its prompt."""
        resumed = resumed or []
        prompt = prompt_token_ids + resumed
        problem = (f"request id {request_id!r} is already in use" if request_id in self.live else
                   checks.request_problem(prompt, params, self.vocab_size, self.max_model_len, True)
                   or unsupported(params))
        if problem:
            return RequestOutput(request_id, [], finish_reason="error", error=problem)
        if (queued := len(self.core.scheduler.waiting)) >= self.config.max_queued_requests:
            return RequestOutput(request_id, [], finish_reason="error", error_kind="busy",
                                 error=f"engine {self.rank} already has {queued} requests waiting "
                                       "(engine.max_queued_requests); retry shortly")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = min(params.max_tokens or room, room) - len(resumed)
        from vllm.v1.engine import EngineCoreRequest

        try:  # vLLM's own validation too (verify): what vLLM's server would refuse is refused here
            request = EngineCoreRequest(request_id, prompt, None, self._sampling(params, max_tokens, len(resumed)),
                                        None, time.time(), self._lora(params.lora), None, None)
            vllm_request, wave = self.core.preprocess_add_request(request)
            self.core.add_request(vllm_request, wave)
        except Exception as exc:  # vLLM's own validation (a grammar it cannot compile, ...)
            return RequestOutput(request_id, [], finish_reason="error", error=f"{type(exc).__name__}: {exc}")
        self.live[request_id] = _Live(time.monotonic())
        return None

    def _sampling(self, params: SamplingParams, max_tokens: int, done: int):
        from vllm import SamplingParams as VllmSamplingParams

        sampling = VllmSamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
            seed=params.seed, repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, max_tokens=max(1, max_tokens),
            min_tokens=max(0, params.min_tokens - done), logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs, logit_bias=dict(params.logit_bias) or None,
            allowed_token_ids=params.allowed_token_ids, detokenize=False,
            structured_outputs=structured(params.constraint) if params.constraint is not None else None,
        )
        sampling.update_from_generation_config({"eos_token_id": self.eos_token_ids}, self.primary_eos)
        if params.bad_words:  # already token ids (the API server tokenized them, as vLLM does)
            sampling._bad_words_token_ids = [list(word) for word in params.bad_words]
        config = self.core.vllm_config
        sampling.verify(self.model_config, config.speculative_config, config.structured_outputs_config,
                        getattr(self.core.structured_output_manager, "tokenizer", None))
        return sampling

    def _lora(self, lora: LoRARequest | None):
        """vLLM's LoRARequest for hybridlb's (an id per name, path and version)."""
        if lora is None:
            return None
        from vllm.lora.request import LoRARequest as VllmLoRARequest

        number = self.adapter_ids.setdefault(lora.key, len(self.adapter_ids) + 1)
        self.adapter_seeds[lora.name] = adapter_seed(hash_seed(self.config.model), lora.key)
        return VllmLoRARequest(lora.name, number, lora.path)

    def load_adapters(self, adapters: list[LoRARequest]) -> None:
        """engine.lora.load eager: vLLM reads each adapter now."""
        for lora in adapters:
            try:
                self.core.add_lora(self._lora(lora))
            except Exception as exc:
                log.warning("engine %d: LoRA adapter %r not loaded: %s", self.rank, lora.name, exc)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Stop requests and free their KV blocks; unknown or finished ids are ignored."""
        known = [request_id for request_id in request_ids if self.live.pop(request_id, None) is not None]
        if known:
            self.core.abort_requests(known)
        return [RequestOutput(request_id, [], finish_reason="abort") for request_id in known]

    # -- the step ------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.core.scheduler.has_requests()

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        try:
            by_client, executed = self.core.step()
            self.core.post_step(executed)
        except Exception as exc:
            return self._recover(exc)
        self.failed_in_a_row = 0
        outputs = []
        for batch in by_client.values():
            self._count(batch.scheduler_stats)
            for output in batch.outputs:
                if (converted := self._output(output)) is not None:
                    outputs.append(converted)
        if executed:
            self.num_steps += 1
            self.busy_s += (seconds := time.perf_counter() - started)
            self.clock.record(seconds, 0)  # vLLM does not say how many tokens it ran: the longest step counts
        return outputs

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """A step raised: vLLM's state for its batch is unknown, so every request here fails (a
        migrating front end moves them), and a fault that repeats makes the engine exit."""
        log.error("engine %d: a vLLM step failed (%s: %s)", self.rank, type(exc).__name__, exc, exc_info=exc)
        self.step_failures += 1
        self.failed_in_a_row += 1
        limit = self.config.max_failed_steps
        if limit and self.failed_in_a_row >= limit:
            raise SickEngine(f"{self.failed_in_a_row} steps in a row failed (engine.max_failed_steps), the last "
                             f"with {type(exc).__name__}: {exc}") from exc
        ids = list(self.live)
        self.live.clear()
        self.core.abort_requests(ids)
        return [RequestOutput(request_id, [], "error", error_kind="internal",
                              error=f"engine {self.rank}: the step failed: {type(exc).__name__}: {exc}")
                for request_id in ids]

    def _output(self, output) -> RequestOutput | None:
        live = self.live.get(output.request_id)
        if live is None:  # aborted meanwhile
            return None
        if output.new_prompt_logprobs_tensors is not None:
            live.prompt_rows.append(output.new_prompt_logprobs_tensors)
        if not output.new_token_ids and output.finish_reason is None:
            return None  # a prefill chunk: nothing to say yet
        reason = FINISH.get(int(output.finish_reason)) if output.finish_reason is not None else None
        stop = output.stop_reason if isinstance(output.stop_reason, int) else None
        if reason == "stop" and stop is None and output.new_token_ids:
            stop = output.new_token_ids[-1]  # the primary eos (vLLM reports no stop_reason for it)
        result = RequestOutput(output.request_id, list(output.new_token_ids), reason, stop,
                               logprobs=logprobs(output.new_logprobs))
        if reason == "error":
            result.error, result.error_kind = f"engine {self.rank}: vLLM failed this request", "internal"
        if not live.answered:
            live.answered = True
            result.prompt_logprobs = prompt_logprobs(live.prompt_rows) if live.prompt_rows else None
            result.prefill_s = round(time.monotonic() - live.arrived, 6)
        if reason is not None:
            del self.live[output.request_id]
        return result

    def _count(self, stats) -> None:
        if stats is None:
            return
        if stats.prefix_cache_stats is not None:
            self.prefix_queries += stats.prefix_cache_stats.queries
            self.prefix_hits += stats.prefix_cache_stats.hits
            self.preemptions += stats.prefix_cache_stats.preempted_requests

    def stats(self) -> EngineStats:
        scheduler = self.core.scheduler
        return EngineStats(
            rank=self.rank, num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_usage=round(scheduler.kv_cache_manager.usage, 4), busy_s=round(self.busy_s, 3), steps=self.num_steps,
            rss_mib=self._resident_mib(), num_preemptions=self.preemptions, prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits, step_failures=self.step_failures,
            longest_step_s=round(max(self.clock.longest_step_s(), self.compile_s), 3),
            **self.clock.by_kind(),
        )

    def _resident_mib(self) -> float:
        now = time.monotonic()
        if now - self._rss[0] >= 1.0:
            self._rss = (now, round(lifecycle.resident_mib(), 1))
        return self._rss[1]

    # -- what the process shell publishes --------------------------------------------
    expert_parallel = None  # dense ranks only (start_checks refuses expert parallelism with this backend)

    def enable_cache_events(self) -> None:
        """Stored and evicted blocks are always recorded (with prefix caching), for the front
        ends; engine.kv_events (publishing them on) is refused with this backend."""

    def take_cache_events(self) -> list[Stored | Removed]:
        """The blocks vLLM cached and evicted since the last call, by hybridlb's hashes."""
        if self.cache_events is None:
            return []
        events, self.cache_events.events = self.cache_events.events, []
        return events

    @property
    def prefix_caching(self) -> bool:
        return self.config.prefix_caching

    @property
    def block_size(self) -> int:
        return self.block_size_

    @property
    def num_kv_blocks(self) -> int:
        return self.num_blocks

    def ready_message(self, dp_group: bool) -> EngineReady:
        """``dp_group`` is not this rank's to claim: vLLM's torch.distributed group is its own (tensor
        parallelism within the rank); across ranks, vLLM ranks are dense and independent."""
        return EngineReady(
            rank=self.rank, model=self.config.model, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            num_kv_blocks=self.num_blocks, block_size=self.block_size_, eos_token_ids=sorted(self.eos_token_ids),
            dp_group=False, simulated=False, prefix_caching=self.config.prefix_caching,
            block_hash_seed=hash_seed(self.config.model), max_queued_requests=self.config.max_queued_requests,
        )

    def label(self) -> str:
        return (f"vLLM {self.version} engine core, {self.model_config.dtype} on {self.config.device}, "
                f"threads bound to cores {os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}, "
                f"logprobs ranking compiled in {self.warm_s:.1f} s")


class _Live:
    """What this backend keeps of a request vLLM runs."""

    __slots__ = ("answered", "arrived", "prompt_rows")

    def __init__(self, arrived: float):
        self.arrived, self.answered, self.prompt_rows = arrived, False, []
