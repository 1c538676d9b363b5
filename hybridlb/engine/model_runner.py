"""Owns the model and its KV cache; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

import logging

import torch

from hybridlb import kernels, lifecycle
from hybridlb.checkpoint.gguf import release_readers
from hybridlb.checkpoint.spec import load_spec
from hybridlb.config import EngineConfig
from hybridlb.engine import kv_cache
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.dtypes import engine_dtype
from hybridlb.engine.expert_parallel import ExpertParallel, expert_range, init_group
from hybridlb.engine.lora import AdapterReader, AdapterWeights
from hybridlb.engine.request import Request
from hybridlb.engine.sampler import Sampler
from hybridlb.engine.scheduler import ScheduledChunk
from hybridlb.engine.weights import engine_quantization, is_gguf, weights_summary
from hybridlb.model import memory
from hybridlb.model.attention import AttentionBatch, DecodeGroup, PagedTable, PrefillChunk
from hybridlb.model.decode_program import DecodeProgram
from hybridlb.model.loader import load_model
from hybridlb.model.lora import ModelAdapters
from hybridlb.params import LoRARequest
from hybridlb.protocol import TokenLogprobs

PROMPT_LOGPROBS_ROWS = 256  # prompt positions scored at once (each holds vocabulary-size floats)
# With the kernels on a CPU with AMX, a fresh bfloat16 prompt of this many tokens or more attends to
# itself on torch's flash attention: 2.2-2.9x the C kernel's speed there (4 x 256 tokens, 9 heads
# of 64: 1.18 against 2.63 ms a layer on a 2-core Xeon); without AMX the kernel is faster.
FLASH_PROMPT_ROWS = 32
log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was configured but torch sees no CUDA device; use device: cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    """See ``engine_dtype``. On this machine's AMX CPU, bfloat16 made SmolLM2-135M's prefill of
    16 x 64 tokens 4.0x faster than float32 and its batch-16 decode step 1.1x faster."""
    return DTYPES[engine_dtype(config)]


def _logprobs_at(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """One position's log-probabilities [vocab]: ``token``'s and the ``top`` largest."""
    if top == 0:
        return TokenLogprobs(token, logprobs[token].item())
    best = logprobs.topk(top)
    return TokenLogprobs(token, logprobs[token].item(), best.indices.tolist(), best.values.tolist())


class ModelRunner:
    scores_logprobs = True

    def __init__(self, config: EngineConfig, dp: DPContext | None = None):
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config)
        self.spec = load_spec(config.model)
        self.max_model_len = self.spec.model_len(config.max_model_len)
        self.block_size = config.block_size
        self.ep: ExpertParallel | None = None  # experts sharded over the ranks (MoE lockstep)
        experts = None
        if dp is not None and dp.lockstep and self.spec.is_moe:
            experts = expert_range(self.spec.num_experts, dp.rank, dp.size)
            group, meta_group = init_group(dp.rendezvous, dp.rank, dp.size, self.device, config.dp_timeout_s,
                                           dp.address)
            self.ep = ExpertParallel(dp.rank, dp.size, self.device, group, meta_group, config.async_dp_coordination)
        gguf_file = is_gguf(config)
        self.quantization = engine_quantization(config, gguf_file)
        self.weights = weights_summary(config, gguf_file)
        self.model = load_model(config.model, self.spec, self.dtype, self.device, self.max_model_len, experts,
                                self.ep, self.quantization)
        fits = kernels.fit(self.device, self.dtype, self.spec.num_heads // self.spec.num_kv_heads,
                           self.spec.head_dim, self.block_size)
        self.kernels = kernels.load() if fits else None
        if self.kernels is not None:
            self.model.use_cpu_kernels(self.kernels, pack_linears=self.dtype == torch.bfloat16)
        self.flash_prompts = self.kernels is not None and self.kernels.tiles and self.dtype == torch.bfloat16
        self.adapters: ModelAdapters | None = None  # LoRA slots, wrapped around the (packed) projections
        if config.lora is not None:
            self.adapters = ModelAdapters(self.model, self.spec, config.lora.max_loras, config.lora.max_lora_rank,
                                          self.dtype, self.device, self.kernels)
            self.adapter_reader = AdapterReader(self.spec, config.lora.max_lora_rank, config.lora.cpu_slots)
        release_readers()
        lifecycle.release_freed_memory()  # loading's and packing's temporaries, the parsed checkpoint
        self.num_blocks = kv_cache.num_blocks(config, self.spec, self.max_model_len, self._gpu_budget(config))
        self._allocate_cache()
        # Steps replayed as one C call where the model is covered (see decode_program.py); up to one
        # decode and its drafts per running request.
        drafts = config.speculative.num_speculative_tokens if config.speculative else 0
        rows = min(config.max_num_seqs * (1 + drafts), config.max_num_batched_tokens)
        self.program = None if config.enforce_eager else DecodeProgram.build(self.model, self.kernels, rows)
        self.sampler = Sampler(self.device, config.seed)
        self._draft_logits: dict[int, torch.Tensor] = {}  # the last step's draft rows, per request

    def label(self) -> str:
        weights = f", {self.weights}" if self.weights else ""
        return f"{self.spec.architecture} in {str(self.dtype).removeprefix('torch.')} on {self.device}{weights}"

    def check_lora(self, lora: LoRARequest) -> AdapterWeights:
        """Read a request's adapter as it comes in (AdapterError if it cannot be served): its
        steps then install tensors already in memory."""
        return self.adapter_reader.read(lora)

    def generator(self, seed: int) -> torch.Generator:
        """A per-request sampling generator."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def skip_draws(self, generator: torch.Generator, steps: int) -> None:
        """Advance a request's generator past ``steps`` sampled tokens: the sampler draws one
        float32 row of noise over the vocabulary per token (Sampler._noise)."""
        row = torch.empty(self.spec.vocab_size, dtype=torch.float32, device=self.device)
        for _ in range(steps):
            row.exponential_(generator=generator)

    def _gpu_budget(self, config: EngineConfig) -> int | None:
        """On CUDA with gpu_memory_utilization: the bytes the KV cache may fill, that fraction of the
        GPU once the weights (already loaded) and the activations of the largest step are set
        aside. Otherwise None (kv_cache_gib sizes the cache)."""
        fraction = config.gpu_memory_utilization
        if fraction is None:
            return None
        if (note := config.kv_cache_size_note(self.device.type)) is not None:
            log.warning("%s", note)
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        spec = self.spec
        # The largest step's activations: its hidden states, MLP input and output in float32
        # (a bound, not a measurement), and the sampled rows' float32 logits.
        width = 2 * spec.hidden_size + 3 * max(spec.intermediate_size, spec.moe_intermediate_size or 0)
        activations = config.max_num_batched_tokens * width * 4 + config.max_num_seqs * spec.vocab_size * 8
        budget = int(fraction * total - (total - free) - activations)
        if budget < kv_cache.bytes_per_block(config, spec):
            raise ValueError(
                f"gpu_memory_utilization={fraction} leaves no room for the KV cache: the GPU has "
                f"{total / 2**30:.1f} GiB, {(total - free) / 2**30:.1f} GiB are in use (weights, other processes) "
                f"and a step needs ~{activations / 2**30:.1f} GiB; raise it, or lower max_num_batched_tokens")
        return budget

    def _allocate_cache(self) -> None:
        layers = self.model.attention_layers()
        shapes = [shape for attention in layers for shape in attention.cache_shapes(self.num_blocks, self.block_size)]
        if self.device.type == "cpu":  # one buffer on huge pages (model/memory.py)
            caches = memory.zeros(shapes, self.dtype)
        else:
            caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes]
        for i, attention in enumerate(layers):
            attention.k_cache, attention.v_cache = caches[2 * i], caches[2 * i + 1]

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Compute every chunk; return one sampled token per chunk that samples, in order. The
        rows of the chunks' drafts are kept for ``sample_draft`` (speculative decoding)."""
        # Decodes (one-token chunks) first, longest context first, so that decodes of
        # similar length sit together and share a batched attention call (the torch path);
        # then the prompt chunks and drafts.
        self._draft_logits = {}
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -c.request.num_computed)
        ordered = decodes + [c for c in chunks if c.num_tokens > 1]
        input_ids, positions, batch, sample_rows = self._prepare(ordered, len(decodes))
        if self.adapters is not None:
            self._use_adapters(ordered)
        if self._replays(batch, len(input_ids)):
            hidden = self.program.forward(input_ids, positions, batch.slot_mapping, batch.tables[0])
        else:
            hidden = self.model(input_ids, positions, batch)
        self._score_prompts(ordered, hidden)
        samplers = [c for c in ordered if c.samples]
        if not samplers:
            return []
        logits = self.model.logits(hidden[sample_rows])
        if len(sample_rows) > len(samplers):  # drafts: their rows wait for sample_draft
            firsts, row = [], 0
            for chunk in samplers:
                firsts.append(row)
                if chunk.draft:
                    self._draft_logits[id(chunk.request)] = logits[row + 1 : row + 1 + len(chunk.draft)]
                row += 1 + len(chunk.draft)
            logits = logits[self._tensor(firsts)]
        sampled = self._sample(logits, [c.request for c in samplers])
        tokens = dict(zip(map(id, samplers), sampled, strict=True))
        return [tokens[id(c)] for c in chunks if c.samples]

    def _replays(self, batch: AttentionBatch, rows: int) -> bool:
        """Whether this step runs as the decode program: every row attends on the kernel, in one table."""
        return (self.program is not None and rows <= self.program.max_rows and len(batch.tables) == 1
                and batch.tables[0].row == 0 and not batch.prefills and not batch.decodes)

    @torch.inference_mode()
    def sample_draft(self, requests: list[Request], position: int) -> list[int]:
        """Sample the row of each request's draft token ``position`` (1-based) of the last step:
        the next token after that draft token, which the request now holds."""
        logits = torch.stack([self._draft_logits[id(r)][position - 1] for r in requests])
        return self._sample(logits, requests)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        scored = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        # The model's log-probabilities, taken before the sampler's penalties change the logits.
        logprobs = torch.log_softmax(logits[scored], dim=-1) if scored else None
        sampled = self.sampler(logits, requests)
        for row, i in enumerate(scored):
            request = requests[i]
            request.logprobs.append(_logprobs_at(logprobs[row], sampled[i], request.params.logprobs))
        return sampled

    def _score_prompts(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> None:
        """prompt_logprobs: the log-probability of each prompt token given the ones before it
        (row p of a chunk predicts token p + 1), for the prompt tokens this step covers that
        are not scored yet (a preempted request recomputes its prompt)."""
        rows, owners = [], []
        row = 0
        for chunk in chunks:
            request, start = chunk.request, chunk.request.num_computed
            if request.prompt_logprobs is not None:
                first = max(start, len(request.prompt_logprobs) - 1)
                last = min(start + chunk.num_tokens, request.num_prompt_tokens - 1)
                for position in range(first, last):
                    rows.append(row + position - start)
                    owners.append((request, request.token_ids[position + 1]))
            row += chunk.num_tokens
        for at in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            logits = self.model.logits(hidden[self._tensor(rows[at : at + PROMPT_LOGPROBS_ROWS])])
            batch = owners[at : at + PROMPT_LOGPROBS_ROWS]
            for logprobs, (request, token) in zip(torch.log_softmax(logits, dim=-1), batch, strict=True):
                request.prompt_logprobs.append(_logprobs_at(logprobs, token, request.params.prompt_logprobs))

    def _prepare(self, chunks: list[ScheduledChunk], num_decodes: int):
        ids, positions, slots, sample_rows, prefills, on_kernel = [], [], [], [], [], []
        for chunk in chunks:
            request, start = chunk.request, chunk.request.num_computed
            end = start + chunk.num_tokens
            row = len(ids)
            ids += chunk.token_ids
            positions += range(start, end)
            slots += [self._slot(request, p) for p in range(start, end)]
            if chunk.samples:  # the last known token's row, and each draft token's
                sample_rows += range(row + chunk.num_tokens - 1 - len(chunk.draft), row + chunk.num_tokens)
            flash = self.flash_prompts and start == 0 and chunk.num_tokens >= FLASH_PROMPT_ROWS
            if flash or (self.kernels is None and chunk.num_tokens > 1):
                prefills.append(self._prefill_chunk(request, row, start, end))
            elif self.kernels is not None:
                on_kernel.append((row, chunk))
        batch = AttentionBatch(slot_mapping=self._tensor(slots), decodes=[], prefills=prefills)
        if self.kernels is None:
            batch.decodes = self._decode_groups([c.request for c in chunks[:num_decodes]])
        batch.tables = [self._paged_table(run) for run in _adjacent_runs(on_kernel)]
        return self._tensor(ids), self._tensor(positions), batch, self._tensor(sample_rows)

    def _use_adapters(self, chunks: list[ScheduledChunk]) -> None:
        """Install the adapters this step's requests were given slots for (read when each request
        came in, ``check_lora``); mark each row's slot."""
        self.adapters.place({c.request.lora_slot: c.request.lora_weights for c in chunks if c.request.lora_slot >= 0})
        rows = [c.request.lora_slot for c in chunks for _ in range(c.num_tokens)]
        self.adapters.rows.set(rows, self.dtype, self.device)

    def _decode_groups(self, requests: list[Request]) -> list[DecodeGroup]:
        """Split decodes (sorted longest first) where padding to the group's longest
        context would more than double the work."""
        groups, start = [], 0
        for row in range(1, len(requests) + 1):
            if row == len(requests) or 2 * len(requests[row].block_ids) <= len(requests[start].block_ids):
                groups.append(self._decode_group(requests[start:row], start))
                start = row
        return groups

    def _paged_table(self, run: list[tuple[int, ScheduledChunk]]) -> PagedTable:
        """The kernel's table for chunks whose rows are adjacent, the first at run[0][0]."""
        chunks = [chunk for _, chunk in run]
        width = max(len(c.request.block_ids) for c in chunks)
        blocks = [c.request.block_ids + [0] * (width - len(c.request.block_ids)) for c in chunks]
        query_start = [0]
        for chunk in chunks:
            query_start.append(query_start[-1] + chunk.num_tokens)
        lengths = [c.request.num_computed + c.num_tokens for c in chunks]
        return PagedTable(torch.tensor(blocks, dtype=torch.int32, device=self.device), self._tensor(query_start),
                          self._tensor(lengths), run[0][0])

    def _decode_group(self, requests: list[Request], start: int) -> DecodeGroup:
        width = len(requests[0].block_ids)
        blocks = [b for r in requests for b in r.block_ids + [0] * (width - len(r.block_ids))]
        keys = torch.arange(width * self.block_size, device=self.device)
        lengths = self._tensor([r.num_computed + 1 for r in requests])
        mask = (keys.unsqueeze(0) < lengths.unsqueeze(1)).view(len(requests), 1, 1, -1)
        return DecodeGroup(start, start + len(requests), self._tensor(blocks), mask)

    def _slot(self, request: Request, position: int) -> int:
        return request.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _prefill_chunk(self, request: Request, row: int, start: int, end: int) -> PrefillChunk:
        if start == 0:
            return PrefillChunk(row, row + end, None, None)
        num_blocks = -(-end // self.block_size)
        keys = torch.arange(num_blocks * self.block_size, device=self.device)
        queries = torch.arange(start, end, device=self.device)
        mask = keys.unsqueeze(0) <= queries.unsqueeze(1)
        return PrefillChunk(row, row + end - start, self._tensor(request.block_ids[:num_blocks]), mask)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _adjacent_runs(rows: list[tuple[int, ScheduledChunk]]) -> list[list[tuple[int, ScheduledChunk]]]:
    """(first row, chunk) pairs in row order, split where a chunk does not start at the previous one's end."""
    runs: list[list[tuple[int, ScheduledChunk]]] = []
    for row, chunk in rows:
        if runs and runs[-1][-1][0] + runs[-1][-1][1].num_tokens == row:
            runs[-1].append((row, chunk))
        else:
            runs.append([(row, chunk)])
    return runs
