"""EngineCore: the whole engine as a plain object — no sockets, no threads.

One ``step()`` is: schedule → run the model → append sampled tokens → finish what
stopped. Front ends (the process shell, the offline ``LLM``) add and abort requests
between steps and forward the returned outputs. Everything outside the engine package
talks to the core through its methods: the scheduler, the block manager, the runner and
the constraints (structured outputs) are its own. ``make_core`` builds the core a config
asks for (the model, or a simulated one).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridlb import lifecycle
from hybridlb.checkpoint.tokenizer import read_eos_token_ids
from hybridlb.config import EngineConfig
from hybridlb.engine import blame, checks
from hybridlb.engine.block_manager import BlockManager
from hybridlb.engine.constraints import Constraints
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.errors import SickEngine
from hybridlb.engine.lora import AdapterSlots, read_for_request
from hybridlb.engine.request import Request
from hybridlb.engine.scheduler import ScheduledChunk, Scheduler
from hybridlb.engine.speculative import NgramProposer
from hybridlb.engine.step_clock import StepClock, step_kind
from hybridlb.params import LoRARequest, SamplingParams
from hybridlb.prefix_hash import adapter_seed, hash_seed
from hybridlb.protocol import EngineReady, EngineStats, RequestOutput

if TYPE_CHECKING:  # torch and the model load only with the real runner (not a simulated one)
    from hybridlb.engine.block_manager import Removed, Stored
    from hybridlb.engine.expert_parallel import ExpertParallel
    from hybridlb.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class _Emitted:
    """What one request got in a step: its new tokens (several when a draft held) and how it ends."""

    chunk: ScheduledChunk
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    stop_token: int | None = None
    error: str | None = None


class EngineCore:
    def __init__(self, config: EngineConfig, dp: DPContext | None = None, runner: ModelRunner | None = None):
        """``runner`` replaces the model (``hybridlb.engine.simulated``); default: load the checkpoint."""
        self.config = config
        self.dp = dp or DPContext()
        self.rank = self.dp.rank
        self.eos_token_ids = set(read_eos_token_ids(config.model))
        self.runner = runner or _load_runner(config, self.dp)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.spec.vocab_size
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.prefix_caching,
                                   hash_seed(config.model))
        proposer = NgramProposer(config.speculative) if config.speculative else None
        adapters = AdapterSlots(config.lora.max_loras) if config.lora else None
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.blocks, proposer, adapters)
        self.requests: dict[str, Request] = {}
        self.constraints = Constraints(config, self.vocab_size, self.rank, self.eos_token_ids)
        self._early_outputs: list[RequestOutput] = []  # decided outside a step: grammars that failed
        self.num_steps = 0
        self.step_failures = 0
        self.failed_in_a_row = 0
        self.busy_s = 0.0
        self.clock = StepClock(config.max_num_batched_tokens)
        self._rss = (0.0, 0.0)  # (when read, MiB): /proc is read at most once a second

    # -- requests in ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resumed: list[int] | None = None) -> RequestOutput | None:
        """Queue a request; on invalid input return its error output instead. ``resumed``: the
        output tokens a migrated request already has (see AddRequest)."""
        resumed = resumed or []
        problem = (f"request id {request_id!r} is already in use" if request_id in self.requests else
                   checks.request_problem(prompt_token_ids + resumed, params, self.vocab_size, self.max_model_len,
                                          self.runner.scores_logprobs))
        adapter = None if problem or params.lora is None else read_for_request(self.config, self.runner, params.lora)
        if isinstance(adapter, str):
            problem = adapter
        if problem:
            return RequestOutput(request_id, [], finish_reason="error", error=problem)
        if (queued := len(self.scheduler.waiting) + len(self.constraints.compiling)) >= self.config.max_queued_requests:
            return RequestOutput(request_id, [], finish_reason="error", error_kind="busy",
                                 error=f"engine {self.rank} already has {queued} requests waiting (their grammars "
                                       "compiling included; engine.max_queued_requests); retry shortly")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = min(params.max_tokens or room, room)
        generator = self.runner.generator(params.seed) if params.seed is not None else None
        if generator is not None and resumed and not params.greedy:
            self.runner.skip_draws(generator, len(resumed))
        request = Request(request_id, prompt_token_ids, params, max_tokens, generator)
        request.token_ids.extend(resumed)  # output already produced: computed with the prompt
        if params.lora is not None:
            request.hash_seed = adapter_seed(self.blocks.seed, params.lora.key)
            request.lora_weights = adapter
        if params.min_tokens:
            eos = set() if params.ignore_eos else self.eos_token_ids
            request.min_tokens_banned = sorted(eos | set(params.stop_token_ids))
        if params.constraint is None:
            self.scheduler.add(request)
        else:  # scheduled once its grammar compiled (see schedule)
            self.constraints.add(request)
        self.requests[request_id] = request
        return None

    def load_adapters(self, adapters: list[LoRARequest]) -> None:
        """engine.lora.load eager: read each adapter now and put it in a free slot (evicting none)."""
        for lora in adapters:
            if isinstance(adapter := read_for_request(self.config, self.runner, lora), str):
                log.warning("engine %d: not loaded: %s", self.rank, adapter)
                continue
            try:
                if (slot := self.scheduler.adapters.take_free(lora)) is not None:
                    self.runner.adapters.place({slot: adapter})
            except Exception:
                log.exception("engine %d: could not place LoRA adapter %r; requests load it when they need it",
                              self.rank, lora.name)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Stop requests and free their KV blocks; unknown or finished ids are ignored."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if not self.constraints.drop(request):
                self.scheduler.finish(request)
            outputs.append(RequestOutput(request_id, [], finish_reason="abort"))
        return outputs

    # -- the step ------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.constraints.compiling) or bool(self._early_outputs)

    def step(self) -> list[RequestOutput]:
        """One step of a dense engine. A step that raises fails only the requests it fails for
        (``_recover``); an expert-parallel engine steps through ``Lockstep``, where a failure
        breaks the group."""
        chunks = self.schedule()
        early = self.take_early_outputs()
        if not chunks:
            if self.constraints.compiling and not early:  # nothing to run until a grammar compiles
                self.constraints.wait_briefly()
            return early
        try:
            outputs = self.run_chunks(chunks)
        except Exception as exc:
            try:
                return early + self._recover(chunks, exc)
            except SickEngine:
                self._early_outputs[:0] = early
                raise
        self.failed_in_a_row = 0
        return early + outputs

    def schedule(self) -> list[ScheduledChunk]:
        """What the next step computes (``Lockstep`` exchanges its size before running it)."""
        if self.constraints.compiling:
            ready, failed = self.constraints.admit()
            for request in ready:
                self.scheduler.add(request)
            for output in failed:
                del self.requests[output.request_id]
            self._early_outputs += failed
        return self.scheduler.schedule()

    def take_early_outputs(self) -> list[RequestOutput]:
        """Outputs decided outside a step (a grammar that failed to compile)."""
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

    def _recover(self, chunks: list[ScheduledChunk], exc: Exception) -> list[RequestOutput]:
        """A step raised (see ``hybridlb.engine.blame``): fail the requests it fails for, alone;
        a fault no request explains counts towards engine.max_failed_steps."""
        log.error("engine %d: a step of %d requests failed (%s: %s); finding whose fault it was", self.rank,
                  len(chunks), type(exc).__name__, exc, exc_info=exc)
        self.step_failures += 1
        if not isinstance(exc, blame.AfterTheStep) and blame.canary_runs(self.runner.run, self.blocks):
            try:
                outputs, culprits = blame.isolate(self.run_chunks, chunks, exc)
                self.failed_in_a_row = 0
                return outputs + [self._fail(chunk.request, error, "invalid") for chunk, error in culprits]
            except blame.AfterTheStep as late:  # a group's outputs failed to be taken in: the engine's fault
                exc = late
        self.failed_in_a_row += 1
        limit = self.config.max_failed_steps
        if limit and self.failed_in_a_row >= limit:  # a sticky fault: every request here would fail
            raise SickEngine(f"{self.failed_in_a_row} steps in a row failed (engine.max_failed_steps), the "
                             f"last with {type(exc).__name__}: {exc}") from exc
        alive = [chunk.request for chunk in chunks if chunk.request.request_id in self.requests]
        return [self._fail(request, exc, "internal") for request in alive]

    def _fail(self, request: Request, exc: Exception, kind: str) -> RequestOutput:
        self.requests.pop(request.request_id, None)
        self.scheduler.finish(request)
        return blame.error_output(self.rank, request.request_id, exc, kind)

    def run_chunks(self, chunks: list[ScheduledChunk], started: float | None = None) -> list[RequestOutput]:
        """Run what ``schedule()`` returned; sample, append, finish. Busy time counts from
        ``started`` (default: now), so work done for the step before it is included."""
        started = time.perf_counter() if started is None else started
        kind = step_kind(chunks)
        tokens = self.runner.run(chunks)
        self.num_steps += 1
        try:
            outputs = self._postprocess(chunks, tokens)
        except Exception as exc:  # tokens may be appended already: this step must not run again
            raise blame.AfterTheStep(f"{type(exc).__name__}: {exc}") from exc
        self.busy_s += (seconds := time.perf_counter() - started)
        self.clock.record(seconds, rows := sum(c.num_tokens for c in chunks), kind)
        if self.scheduler.proposer is not None and kind == "decode" and chunks:  # drafts' cost: time per row
            self.scheduler.proposer.cost.timed(rows, seconds)
        return outputs

    def dummy_step(self, started: float) -> None:
        """Expert parallel: a step with no tokens that still joins every MoE layer's collectives
        (busy time since ``started``, as a real step's)."""
        self.runner.run([])
        self.busy_s += time.perf_counter() - started

    @property
    def expert_parallel(self) -> ExpertParallel | None:
        """The group this rank's MoE layers share with the other ranks (None: dense, or all experts here)."""
        return self.runner.ep

    def _postprocess(self, chunks: list[ScheduledChunk], tokens: list[int]) -> list[RequestOutput]:
        sampled = iter(tokens)
        emitted = []
        for chunk in chunks:
            request, samples = chunk.request, chunk.samples
            request.num_computed += chunk.num_tokens - len(chunk.draft)
            if samples:
                emitted.append(self._accept(_Emitted(chunk), next(sampled)))
            else:
                self.blocks.cache_computed(request)
        drafted = [e for e in emitted if e.chunk.draft]
        self._verify_drafts(drafted)
        for e in drafted:
            self.scheduler.proposer.checked(e.chunk.request, len(e.chunk.draft), len(e.tokens) - 1)
        outputs = []
        for e in emitted:
            request = e.chunk.request
            self.blocks.cache_computed(request)
            outputs.append(self._output(request, e))
            if e.reason is not None:
                self.scheduler.finish(request)
                del self.requests[request.request_id]
        return outputs

    def _accept(self, e: _Emitted, token: int) -> _Emitted:
        """A sampled token joins its request: follow the grammar, decide whether it finishes."""
        request = e.chunk.request
        request.token_ids.append(token)
        e.tokens.append(token)
        try:
            reason, stop_token, error = (self.constraints.follow(request, token) if request.grammar
                                         else (None, None, None))
        except Exception as exc:  # this request's grammar, not the step's
            reason, stop_token, error = "error", None, f"engine {self.rank}: its grammar failed: {exc!r}"
        if reason is None:
            reason, stop_token = self._finish_reason(request, token)
        e.reason, e.stop_token, e.error = reason, stop_token, error
        return e

    def _verify_drafts(self, drafting: list[_Emitted]) -> None:
        """Speculative decoding (see hybridlb.engine.speculative): while a request's newest token
        equals its draft's next one, that draft token's KV holds and the model's row after it is
        the request's true next distribution: sample it, as the step would have without a draft."""
        stats, position = self.scheduler.spec_stats, 0
        while drafting := [e for e in drafting if position < len(e.chunk.draft) and e.reason is None
                           and e.tokens[-1] == e.chunk.draft[position]]:
            for e in drafting:
                stats.accepted(position)
                e.chunk.request.num_computed += 1
            position += 1
            for e, token in zip(drafting, self.runner.sample_draft([e.chunk.request for e in drafting], position),
                                strict=True):
                self._accept(e, token)

    def _output(self, request: Request, e: _Emitted) -> RequestOutput:
        logprobs, prompt_logprobs = request.take_logprobs()
        output = RequestOutput(request.request_id, e.tokens, e.reason, e.stop_token, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs)
        if e.error is not None:  # its own masks leaving the grammar no token is the request's fault
            output.error, output.error_kind = e.error, "invalid" if request.restricts_tokens else "internal"
        if request.num_output_tokens == len(e.tokens) and request.scheduled_at is not None:  # its first
            output.queued_s = round(request.scheduled_at - request.arrived_at, 6)
            output.prefill_s = round(time.monotonic() - request.scheduled_at, 6)
        return output

    def _finish_reason(self, request: Request, token: int) -> tuple[str | None, int | None]:
        if token in request.stop_ids or (token in self.eos_token_ids and not request.params.ignore_eos):
            return "stop", token
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def stats(self) -> EngineStats:
        spec = self.scheduler.spec_stats
        return EngineStats(
            rank=self.rank,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.constraints.compiling),  # as vLLM's WAITING_FOR_FSM
            kv_usage=round(self.blocks.usage, 4),
            busy_s=round(self.busy_s, 3),
            steps=self.num_steps,
            rss_mib=self._resident_mib(),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_queries=self.blocks.queried_tokens,
            prefix_hits=self.blocks.hit_tokens,
            cached_blocks=self.blocks.num_cached,
            step_failures=self.step_failures,
            longest_step_s=round(self.clock.longest_step_s(), 3),
            **self.clock.by_kind(),
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_pos=list(spec.accepted_per_position),
            **self.scheduler.adapter_stats(),
        )

    def _resident_mib(self) -> float:
        now = time.monotonic()
        if now - self._rss[0] >= 1.0:
            self._rss = (now, round(lifecycle.resident_mib(), 1))
        return self._rss[1]

    # -- what the process shell publishes --------------------------------------------
    def enable_cache_events(self) -> None:
        """Record blocks entering and leaving the cache (front ends route by them, a KV-event
        publisher sends them on); ``take_cache_events`` hands them out."""
        self.blocks.record_events = self.blocks.record_stored = self.blocks.caching

    def take_cache_events(self) -> list[Stored | Removed]:
        return self.blocks.take_events()

    @property
    def prefix_caching(self) -> bool:
        return self.blocks.caching

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.blocks.num_blocks

    def ready_message(self, dp_group: bool) -> EngineReady:
        """What this engine tells a front end that registers (``dp_group``: it joined a
        torch.distributed group across ranks)."""
        return EngineReady(
            rank=self.rank, model=self.config.model, max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, num_kv_blocks=self.blocks.num_blocks, block_size=self.blocks.block_size,
            eos_token_ids=sorted(self.eos_token_ids), dp_group=dp_group, simulated=self.config.simulate is not None,
            prefix_caching=self.blocks.caching, block_hash_seed=self.blocks.seed,
            max_queued_requests=self.config.max_queued_requests,
        )

    def label(self) -> str:
        """What this engine is, for its start-up log line."""
        spec = self.config.speculative
        return self.runner.label() + (f", speculative {spec.method} x{spec.num_speculative_tokens}" if spec else "")


def _load_runner(config: EngineConfig, dp: DPContext) -> ModelRunner:
    from hybridlb.engine.model_runner import ModelRunner

    return ModelRunner(config, dp)


class SimulatedCore(EngineCore):
    """An ``EngineCore`` whose model is ``SimulatedRunner`` (``hybridlb.engine.simulated``)."""

    def __init__(self, config: EngineConfig, dp: DPContext | None = None):
        from hybridlb.engine.simulated import SimulatedRunner

        super().__init__(config, dp, runner=SimulatedRunner(config))


def make_core(config: EngineConfig, dp: DPContext | None = None) -> EngineCore:
    """The engine core ``config`` asks for: vLLM's (``engine.backend: vllm``), simulated when
    ``engine.simulate`` is set, else the model."""
    if config.backend == "vllm":
        from hybridlb.engine.vllm_backend import VllmCore

        return VllmCore(config, dp)
    return SimulatedCore(config, dp) if config.simulate is not None else EngineCore(config, dp)
