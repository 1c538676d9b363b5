"""The serving sections: ``api`` (the HTTP server), ``data_parallel`` (ranks, nodes and their
wiring), ``lb`` (load-balancing mode and policy) and ``ray`` (placement for ``hybridlb up``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hybridlb.config.base import _Section, raise_all
from hybridlb.config.flags import flag

SERVE_PLAN = ("serve", "plan")  # the commands that take the cluster's layout


class ApiConfig(_Section):
    """The OpenAI-compatible HTTP server of each node."""

    host: str = Field("127.0.0.1", description="Interface to listen on; 0.0.0.0 for all (loopback by default).",
                      json_schema_extra=flag(vllm=True, commands=SERVE_PLAN))
    port: int = Field(8000, ge=0, le=65535, description="HTTP port.",
                      json_schema_extra=flag(vllm=True, commands=SERVE_PLAN))
    served_model_name: str | list[str] | None = Field(
        None, description="Model name clients send, or several (the first names the metrics); defaults to "
        "engine.model exactly as given (for a bundled model, its own name first, e.g. SmolLM2-135M-Instruct).",
        json_schema_extra=flag(vllm=True, parse="one_or_list",
                               note="Repeat it, or list several after it as vLLM does."),
    )
    api_key: str | None = Field(
        None, description="Bearer token required on every route but /health, /load, /metrics and /version "
        "(also read from HYBRIDLB_API_KEY, then VLLM_API_KEY).",
        json_schema_extra=flag(vllm=True),
    )
    max_body_bytes: int = Field(8 * 2**20, ge=1024, description="Larger request bodies get 413.")
    max_body_bytes_in_flight: int = Field(
        512 * 2**20, ge=0, description="Request bodies one API server process holds at once, in bytes (a body is "
        "held until its response ends); past it a request gets 429 with Retry-After. 0: no limit (then the bound "
        "is max_body_bytes x max_concurrent_requests)."
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request body not received whole this long after the request began gets 408 "
        "(a slow or stalled upload gives back its concurrency slot)."
    )
    max_concurrent_requests: int = Field(
        4096, ge=0, description="Requests one API server process works on at once (streams included); more get "
        "429 with Retry-After. /health, /load, /metrics and /version are never refused. 0: no limit.",
        json_schema_extra=flag(),
    )
    request_timeout_s: float = Field(
        300.0, ge=0, description="Fail a request (504) when its engine has sent nothing for it this long: a "
        "last line of defence against a lost output. A request waiting in a long queue counts as silent too, so "
        "keep it above the longest queue wait plus prefill you expect. 0: never.",
        json_schema_extra=flag("--request-timeout"),
    )
    engine_stall_s: float = Field(
        10.0, ge=0, description="An engine with requests in flight that sends nothing (no output, no 1 s "
        "heartbeat) this long, or for 3 times the longest step it says it may take (its recent steps, a full "
        "token budget at their slowest rate) if that is longer, is stuck: its requests move to another engine "
        "and it is asked to register again, counting as down until it answers. 0: never."
    )
    migration_limit: int = Field(
        3, ge=0, description="Dense models: times one request may move to another engine of the node when its "
        "engine dies or is lost mid-stream; it goes on from the tokens it has, and the client's stream goes on "
        "without a gap (a greedy or seeded request gives the text it would have given). 0: fail such "
        "requests. MoE lockstep groups always fail them (the group's collectives broke).",
        json_schema_extra=flag(),
    )
    shutdown_timeout_s: float = Field(
        0.0, ge=0, description="On SIGTERM or Ctrl-C, how long requests in flight may finish before the node "
        "stops (vLLM's --shutdown-timeout). Its API servers stop accepting connections at once, so a load "
        "balancer sends new requests elsewhere, and the engines serve on until the last request ends or this "
        "runs out; a request still running then ends with an error event. 0: stop at once. A second signal "
        "stops at once either way.",
        json_schema_extra=flag("--shutdown-timeout", vllm=True),
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "warning", description="The HTTP server's (uvicorn's) own log level: vLLM's --uvicorn-log-level. hybridlb's "
        "own log lines follow the HYBRIDLB_LOG_LEVEL environment variable (default INFO).",
        json_schema_extra=flag("--uvicorn-log-level", vllm=True))
    chat_template: str | None = Field(
        None, description="Chat template replacing the checkpoint's own: a .jinja file or the template text.",
        json_schema_extra=flag(vllm=True),
    )
    generation_config: str = Field(
        "auto", description="Sampling defaults for fields a request leaves unset: auto (the model's "
        "generation_config.json), vllm (none: OpenAI's defaults) or a directory holding generation_config.json.",
        json_schema_extra=flag(vllm=True),
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(
        None, description="How tool calls are read out of the model's text (tool_choice auto); vLLM's "
        "--tool-call-parser. Forced calls (required, a named function) need no parser.",
        json_schema_extra=flag(vllm=True),
    )
    enable_auto_tool_choice: bool = Field(
        False, description="Allow tool_choice auto (the default when a request has tools): the model decides, "
        "tool_call_parser reads its calls. vLLM's --enable-auto-tool-choice.",
        json_schema_extra=flag(vllm=True),
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None, description="Split <think>...</think> into reasoning_content; structured output and tool calls "
        "apply after it. vLLM's --reasoning-parser.",
        json_schema_extra=flag(vllm=True),
    )

    @model_validator(mode="after")
    def _check_together(self) -> ApiConfig:
        problems = []
        if 0 < self.max_body_bytes_in_flight < self.max_body_bytes:
            problems.append(f"api.max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) is below "
                            f"api.max_body_bytes ({self.max_body_bytes}): the largest body could never be taken; "
                            "raise it")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            problems.append("api.enable_auto_tool_choice needs api.tool_call_parser (hermes, llama3_json, mistral "
                            "or pythonic)")
        raise_all(problems)
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


LOOPBACK = ("127.0.0.1", "localhost", "::1")


class DataParallelConfig(_Section):
    """How ranks are spread over nodes. The per-node fields describe the node this
    process runs on (as the ``--data-parallel-*`` flags do); ``nodes`` may describe the
    whole cluster instead."""

    def open_handshake_warning(self) -> str | None:
        """The head's warning when it takes nodes with no cluster token beyond loopback, or None
        (whether there is a token is the caller's: the environment may hold it)."""
        if self.address in LOOPBACK:
            return None
        return (f"no cluster token: any host that reaches {self.address}:{self.rpc_port} can join the cluster (and "
                "learn the key its other sockets use for this run); set --cluster-token")

    size: int = Field(1, ge=1, description="Data-parallel ranks in the whole cluster.",
                      json_schema_extra=flag("--data-parallel-size", "-dp", vllm=True, commands=SERVE_PLAN))
    size_local: int | None = Field(None, ge=1, description="Ranks on this node; default: all (one node).",
                                   json_schema_extra=flag("--data-parallel-size-local", vllm=True, commands=SERVE_PLAN))
    start_rank: int = Field(0, ge=0, description="Global rank of this node's first engine.",
                            json_schema_extra=flag("--data-parallel-start-rank", vllm=True, commands=SERVE_PLAN))
    rank: int | None = Field(
        None, ge=0, description="External LB: this server runs and serves exactly this one rank.",
        json_schema_extra=flag("--data-parallel-rank", vllm=True, commands=SERVE_PLAN),
    )
    address: str = Field("127.0.0.1", description="Address of the start-rank-0 node (coordinator, rpc port).",
                         json_schema_extra=flag("--data-parallel-address", vllm=True, commands=SERVE_PLAN))
    rpc_port: int = Field(
        29550, ge=1, le=65500, description="Handshake port on the head node, which also takes rpc_port + 1 to + 4 "
        "(the coordinator); internal-LB engines listen on rpc_port + 16 + rank.",
        json_schema_extra=flag("--data-parallel-rpc-port", vllm=True, commands=SERVE_PLAN))
    node_address: str | None = Field(
        None, description="Address other nodes reach this node at (internal LB); default: address if loopback.",
        json_schema_extra=flag("--data-parallel-node-address", vllm=True, commands=SERVE_PLAN),
    )
    headless: bool = Field(False, description="This node runs engines only, no API server.",
                           json_schema_extra=flag(vllm=True, commands=SERVE_PLAN))
    nodes: list[NodeConfig] | None = Field(None, description="The whole cluster, one entry per node.")
    cluster_token: str | None = Field(
        None, description="Shared secret a node must present to join (also HYBRIDLB_CLUSTER_TOKEN).",
        json_schema_extra=flag(envvar="HYBRIDLB_CLUSTER_TOKEN"),
    )
    restart_policy: Literal["none", "restart"] = Field(
        "none",
        description="When a component dies. none: report it (/health, /ranks, status) and keep serving with "
        "the rest. restart: bring it back in place (serve: the node restarts a dense engine, the coordinator "
        "or an API server, at most 3 times a minute each; a broken MoE group makes the node exit for its "
        "supervisor to recreate; up: Ray restarts the actor).",
        json_schema_extra=flag(),
    )


class AutoscalingConfig(_Section):
    """Resize a one-node cluster (``serve`` or ``up``) by its load (``hybridlb.launch.autoscale``): the
    launcher reads every rank's running and waiting requests from the coordinator each second
    and moves to ``ceil(ongoing / target_ongoing_requests)`` ranks within the bounds, once that
    has been wanted for the delay. Names as Ray Serve's ``autoscaling_config`` has them."""

    min_replicas: int = Field(1, ge=1, description="Fewest ranks to shrink to.")
    max_replicas: int = Field(1, ge=1, description="Most ranks to grow to (at most the node's CPU cores).")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Running plus waiting requests per rank to aim for: more for longer grows the node, "
        "fewer for longer shrinks it.")
    upscale_delay_s: float = Field(30.0, ge=0, description="Seconds more ranks must be wanted before the node grows.")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="Seconds fewer ranks must be wanted before the node shrinks.")
    drain_timeout_s: float = Field(
        120.0, gt=0, description="When shrinking: how long leaving ranks may finish their requests before the "
        "rest move to the ranks that stay.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling.min_replicas={self.min_replicas} is above max_replicas="
                             f"{self.max_replicas}; lower the one or raise the other")
        return self


class LoadBalancingConfig(_Section):
    """How requests are spread over the ranks: which API servers there are, and how they pick a rank."""

    mode: Literal["hybrid", "internal", "external", "multi_port"] = Field(
        "hybrid",
        description="hybrid: an API server per node over its own ranks; internal: API servers on the head "
        "over all ranks; external: one API server per rank, an outside balancer picks; multi_port: external's "
        "one API server per local rank (port + i) under a node supervisor whose port answers the node's "
        "probes (vLLM's --data-parallel-multi-port-external-lb, llm-d's pod shape).",
        json_schema_extra=flag("--lb-mode", commands=SERVE_PLAN, parse="dashes"),
    )
    api_servers_per_node: int | Literal["auto"] = Field(
        1, description="API server processes per node sharing its port (SO_REUSEPORT); auto: from local engines.",
        json_schema_extra=flag(commands=SERVE_PLAN, parse="count_or_auto"),
    )
    policy: Literal["cache_aware", "least_loaded", "round_robin"] = Field(
        "cache_aware",
        description="cache_aware: the rank that serves the prompt cheapest, in prompt tokens (its queued prefill, "
        "the prompt's uncached tokens times 1 + the requests there, 128 per request there weighted by the share "
        "of this request's max_tokens it still has to go; never a rank 8 requests busier than the least "
        "loaded); least_loaded: lowest 4*waiting + running (+ own requests the stats do not show yet), ties "
        "rotate; round_robin: in turn.",
        json_schema_extra=flag("--lb-policy"),
    )
    supervisor_port: int = Field(
        9256, ge=1, le=65535, description="multi_port: where the node supervisor answers /health, /ready and "
        "/readyz for every local rank (vLLM's --data-parallel-supervisor-port).",
        json_schema_extra=flag("--data-parallel-supervisor-port", vllm=True, commands=SERVE_PLAN),
    )
    supervisor_probe_interval_s: float = Field(
        5.0, gt=0, description="multi_port: how often the supervisor probes each rank's /health.",
        json_schema_extra=flag("--dp-supervisor-probe-interval-s", vllm=True, commands=SERVE_PLAN))
    supervisor_probe_timeout_s: float = Field(
        5.0, gt=0, description="multi_port: how long one probe may take.",
        json_schema_extra=flag("--dp-supervisor-probe-timeout-s", vllm=True, commands=SERVE_PLAN))
    supervisor_probe_failure_threshold: int = Field(
        3, ge=1, description="multi_port: failed probes in a row before a rank counts as down (a rank whose "
        "process died is down at once).",
        json_schema_extra=flag("--dp-supervisor-probe-failure-threshold", vllm=True, commands=SERVE_PLAN))

    @model_validator(mode="after")
    def _positive(self) -> LoadBalancingConfig:
        if self.api_servers_per_node != "auto" and self.api_servers_per_node < 1:
            raise ValueError("api_servers_per_node must be at least 1 or 'auto'")
        return self


class RayConfig(_Section):
    """How ``hybridlb up`` places the cluster on Ray."""

    address: str | None = Field(
        None, description="Ray cluster to join ('auto' or HOST:PORT); none starts a private local one.",
        json_schema_extra=flag(commands=("up",)),
    )
    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="Cluster name: actors are named "
                      "hybridlb:<name>:<role>.", json_schema_extra=flag(commands=("up",)))
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


