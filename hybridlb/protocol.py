"""Every message that crosses a process boundary, and the sockets that carry them.

All messages are msgspec structs encoded as msgpack, one message per ZMQ frame
(after the routing identity where the socket type adds one). Each struct carries a
short ``type`` tag, so a socket decodes into the union of what it may receive and a
malformed or unexpected frame is a clean ``msgspec.DecodeError`` / ``ValidationError``
that the receiver logs and drops.

Sockets
-------

Engine input/output — one per engine (one per data-parallel rank).
    The engine **binds** a ROUTER socket at its address (``tcp://host:port`` or
    ``ipc://path``); each front end (API server, offline client, test) **connects** a
    DEALER socket with a unique identity. Both directions share the socket, so outputs
    always go back to the front end that sent the request.

    front end → engine : ``Hello``          register; the engine answers ``EngineReady``
                                            once its model is loaded (readiness handshake)
    front end → engine : ``AddRequest``     start generating for one request
    front end → engine : ``AbortRequests``  stop requests, free their KV blocks; each
                                            live one is answered with finish_reason "abort"
    engine → front end : ``EngineReady``    answer to ``Hello``: rank, limits, eos ids
    engine → front end : ``EngineOutputs``  after each step: new tokens and finishes for
                                            this front end's requests, plus ``EngineStats``
                                            whenever (running, waiting, KV usage) changed;
                                            at least every second (a heartbeat). ``seq``
                                            counts them per front end from 1 after each
                                            ``EngineReady``: a gap means outputs were lost
                                            and the front end fails that engine's requests

    Nothing is dropped on the way out: the engine's ROUTER queues without a limit for a
    front end that reads slowly (an API server stalled by a GC pause or a large
    tokenization gets everything once it resumes) and pings every front end; one that
    stays silent for ``FRONT_END_SILENCE_S`` is disconnected and its requests aborted.
    A ``Hello`` from a front end the engine knows means it starts over: the engine aborts
    that front end's requests before answering.

Coordinator stats in — one per cluster, on the head node (``rpc_port + 1``).
    The coordinator **binds** PULL; every engine **connects** PUSH.

    engine → coordinator : ``EngineStats``   whenever its load changed (``seq`` counts up),
                                             and at least every second (a heartbeat: a rank
                                             silent for 3 s is listed as lost)
    engine → coordinator : ``StartWave``     MoE: a paused engine got a request
    engine → coordinator : ``WaveComplete``  MoE, rank 0: no rank had work; the wave is over

Coordinator waves out — MoE with expert parallelism only (``rpc_port + 4``).
    The coordinator **binds** PUB; every engine **connects** SUB.

    coordinator → engines : ``StartWave``  resume (every engine but the one that asked); while
                                           a wave runs it is repeated every second (rank -1),
                                           so an engine that missed it (a restarted
                                           coordinator, a late subscriber) still joins

Coordinator loads out — (``rpc_port + 2``).
    The coordinator **binds** PUB; every API server **connects** SUB (no topic filter).

    coordinator → API servers : ``LoadSnapshot``  every rank's latest stats, at most every
                                                  100 ms while they change, else every 1 s
                                                  as a heartbeat

Handshake — the rpc port (``rpc_port``) of the head node (start rank 0).
    The head's launcher **binds** ROUTER; every other node's launcher **connects**
    DEALER. A node registers, is accepted or rejected, loads its engines, reports ready;
    the head answers everyone with ``ClusterReady`` once every rank is up (the readiness
    barrier), then sends a ``Heartbeat`` every second until it stops (``Shutdown``). A
    node that hears nothing from the head for 5 s shuts itself down.

    node → head : ``RegisterNode``   its ranks, the cluster size, model and config fingerprints
    head → node : ``NodeAccepted``   coordinator and rendezvous addresses
    head → node : ``NodeRejected``   why (mismatch, overlap, bad token); the node exits
    node → head : ``NodeReady``      its engines are loaded
    head → node : ``ClusterReady``   every rank is up: serve; engine addresses of all ranks
    head → node : ``Heartbeat``      every second
    head → node : ``Shutdown``       the head is stopping; so does the node

Bad input
---------

A receiver drops what it cannot use with one warning line saying why (undecodable, the
wrong type, the wrong number of frames, values out of range) and keeps its connections.
Every socket that binds and receives from other processes also sets ``ZMQ_MAXMSGSIZE``,
so a frame over its limit drops the sender's connection before it is buffered (ZMQ
reads no further, so nothing is decoded or logged):

    engine input          ``engine_input_limit(max_model_len)``: 2 MiB plus 9 bytes (the
                          largest msgpack integer) per token of the longest prompt
    coordinator           ``COORDINATOR_LIMIT`` (64 KiB; an ``EngineStats`` is ~200 bytes;
                          its PUB sockets take in only subscriptions)
    handshake             ``HANDSHAKE_LIMIT`` (1 MiB; a ``RegisterNode`` of 1,000 ranks is ~30 KiB)
    KV events             ``kv_events.REQUEST_LIMIT`` (4 KiB: subscriptions, 8-byte replay requests)

The limit is per frame: ZMQ buffers a multipart message whole, so without a cluster token
(which makes every TCP socket a CURVE server that an outsider cannot finish a handshake
with) these sockets must only be reachable from the cluster's own network.
"""

from __future__ import annotations

import msgspec

from hybridlb.params import LoRARequest, SamplingParams

FinishReason = str  # "stop" | "length" | "abort" | "error"
class Hello(msgspec.Struct, tag="hello"):
    client_id: str


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    wave: int = 0  # the sender's latest view of the current wave (MoE); a newer one is adopted
    # A migrated request (its engine died): the tokens it already produced elsewhere. The
    # engine computes them with the prompt and goes on from there as if it had sampled them:
    # they count as output (max_tokens, penalties, min_tokens, the grammar) and a seeded
    # request's generator is advanced past them, so the rest is what the first engine would
    # have produced.
    resumed: list[int] = msgspec.field(default_factory=list)


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class LoadAdapters(msgspec.Struct, tag="load_adapters"):
    """engine.lora.load eager: read these adapters now, and place them in free slots."""

    adapters: list[LoRARequest]


class EngineReady(msgspec.Struct, tag="ready"):
    rank: int
    model: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    dp_group: bool = False  # whether this engine joined a torch.distributed group across ranks
    simulated: bool = False  # engine.simulate: no model, steps only sleep (control-plane benchmarks)
    prefix_caching: bool = False  # whether it reuses cached prompt prefixes
    block_hash_seed: int = 0  # the start of its block-hash chain (hybridlb.prefix_hash)
    max_queued_requests: int = 0  # beyond this many waiting it refuses requests ("busy"); 0: unknown


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one position: of the token there, and of the most likely tokens."""

    token_id: int
    logprob: float
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


class RequestOutput(msgspec.Struct, omit_defaults=True):
    """New tokens of one request since its last output; ``finish_reason`` set on its last.
    With SamplingParams.logprobs, one TokenLogprobs per new token; with prompt_logprobs,
    the first output carries one per prompt token (None for the first, which has no context)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    error: str | None = None
    # With ``error``: "invalid" (the request's fault, 400), "busy" (the engine's queue is full,
    # 429: another engine or a retry may take it) or "internal" (the step failed, 500).
    error_kind: str = "invalid"
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # On the first token's output: seconds the request waited before it was first scheduled,
    # then from there to its first token (the engine's own clock; vLLM's queue / prefill times).
    queued_s: float | None = None
    prefill_s: float | None = None


class EngineStats(msgspec.Struct, tag="stats"):
    rank: int
    num_running: int
    num_waiting: int
    kv_usage: float
    seq: int = 0  # counts up with every change, so the newest view of an engine wins
    epoch: int = 0  # when this engine process started (ns): a restarted engine's seq starts over
    dummy_steps: int = 0  # steps run with no work to stay in lockstep (MoE only)
    busy_s: float = 0.0  # time spent stepping since start, dummy steps included (rides along)
    wave: int = 0  # expert parallel: the wave this engine is in (or will start next)
    running: bool = False  # expert parallel: whether its wave is running
    collective_s: float = 0.0  # expert parallel: time in the MoE layers' collectives since start
    meta_s: float = 0.0  # expert parallel: time blocked on the per-step metadata exchange
    steps: int = 0  # steps that ran real tokens
    rss_mib: float = 0.0  # the engine process's resident memory (rides along, refreshed every second)
    num_preemptions: int = 0  # requests preempted since start (rides along)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache since start (rides along)
    prefix_hits: int = 0  # of those, found cached (rides along)
    cached_blocks: int = 0  # KV blocks holding reusable content, in use or not (rides along)
    orphans_aborted: int = 0  # requests aborted because their front end was gone (rides along)
    step_failures: int = 0  # steps that raised; their requests failed (rides along)
    longest_step_s: float = 0.0  # the longest a step may take here, by recent steps (engine.step_clock; rides along)
    borrowed_steps: int = 0  # steps run on cores borrowed from the node's idle engines (rides along)
    # Where the engine's time went since start (rides along; engine.step_clock): steps by kind
    # (decode, mixed, prefill, unclassified) and the loop's phases (idle: waiting for work;
    # take: taking messages in; step: the whole step, scheduling included; publish: outputs
    # and stats out), with the loop's wall time they add up to.
    step_s: dict[str, float] = msgspec.field(default_factory=dict)
    step_counts: dict[str, int] = msgspec.field(default_factory=dict)
    step_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    loop_s: dict[str, float] = msgspec.field(default_factory=dict)
    uptime_s: float = 0.0  # the loop's wall time since it started
    # Speculative decoding since start (rides along): drafts, their tokens, tokens accepted,
    # and acceptances at each draft position.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    # LoRA: the adapters in the engine's slots (most recently used last), and those its running
    # and waiting requests name (vLLM's lora_requests_info).
    lora_loaded: list[str] = msgspec.field(default_factory=list)
    lora_running: list[str] = msgspec.field(default_factory=list)
    lora_waiting: list[str] = msgspec.field(default_factory=list)
    lora_loads: int = 0  # adapters placed into a slot since start (rides along)


RESTART_SILENCE_S = 1.5  # an epoch unheard this long (engines report every second) has ended


def is_newer(stats: EngineStats, than: EngineStats | None, than_silent_s: float = 0.0) -> bool:
    """Whether ``stats`` is a later view of its engine than ``than``. A restart starts a new
    epoch (the engine's start time): a larger one is newer at once; any other epoch is newer
    once ``than``'s epoch has been silent for ``RESTART_SILENCE_S`` (``than_silent_s``), so an
    engine restarted after the wall clock stepped back is still heard, while a late message
    of a live epoch is not taken for a restart."""
    if than is None or (stats.epoch, stats.seq) > (than.epoch, than.seq):
        return True
    return stats.epoch != than.epoch and than_silent_s > RESTART_SILENCE_S


class WaveComplete(msgspec.Struct, tag="wave_complete"):
    """Rank 0, when a step found no work on any rank: wave ``wave`` is over."""

    wave: int


class StartWave(msgspec.Struct, tag="start_wave"):
    """A paused engine got a request: wave ``wave`` must run (engine → coordinator), or
    runs now (coordinator → every engine but ``rank``)."""

    wave: int
    rank: int


class RankCount(msgspec.Struct, tag="rank_count"):
    """The node's launcher, after a resize (``hybridlb.launch.scaling``): the cluster now has
    ranks 0..size-1; stats of ranks above are dropped and they no longer count as lost."""

    size: int


class EngineOutputs(msgspec.Struct, tag="outputs"):
    rank: int
    outputs: list[RequestOutput]
    stats: EngineStats | None = None
    # Hashes of cached blocks evicted since the last message (prefix caching): every front
    # end gets them, so its routing index stops counting on them.
    evicted: list[int] = msgspec.field(default_factory=list)
    seq: int = 0  # this message's number for its front end, from 1 after each EngineReady
    # Hashes of blocks that entered the cache since the last message, prompts' and generated
    # ones': every front end records them, so a chat's next turn finds the rank holding its
    # history whichever of the node's API servers sent the last one.
    stored: list[int] = msgspec.field(default_factory=list)


class LoadSnapshot(msgspec.Struct, tag="loads"):
    engines: list[EngineStats]  # latest stats of every rank that reported, by rank
    current_wave: int = 0
    engines_running: bool = False
    wave_messages: int = 0  # wave coordination messages seen (always 0 for dense models)
    waves_completed: int = 0
    lost_ranks: list[int] = msgspec.field(default_factory=list)  # silent for LOST_AFTER_S (dead or cut off)


class RegisterNode(msgspec.Struct, tag="register"):
    start_rank: int
    size_local: int
    size: int
    model_fingerprint: str
    config_hash: str
    token: str = ""
    engine_addresses: dict[int, str] = msgspec.field(default_factory=dict)
    hostname: str = ""


class NodeAccepted(msgspec.Struct, tag="accepted"):
    coordinator_stats: str | None
    coordinator_loads: str | None
    rendezvous: str | None  # MoE lockstep: torch.distributed init address
    coordinator_waves: str | None = None  # MoE lockstep: where StartWave is published
    session_key: str = ""  # no cluster token: the CURVE secret the head drew for this run (transport.py)


class NodeRejected(msgspec.Struct, tag="rejected"):
    reason: str


class NodeReady(msgspec.Struct, tag="node_ready"):
    start_rank: int


class NodeLeaving(msgspec.Struct, tag="node_leaving"):
    """A node stopping in order: in a dense cluster that may grow, its ranks leave the cluster
    (the head shrinks it when they were the last ones) instead of counting as lost."""

    start_rank: int


class ClusterReady(msgspec.Struct, tag="cluster_ready"):
    engine_addresses: dict[int, str]


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    pass


class Shutdown(msgspec.Struct, tag="shutdown"):
    reason: str


ToEngine = Hello | AddRequest | AbortRequests | StartWave | LoadAdapters
FromEngine = EngineReady | EngineOutputs
ToCoordinator = EngineStats | WaveComplete | StartWave | RankCount
ToHead = RegisterNode | NodeReady | NodeLeaving | Heartbeat
FromHead = NodeAccepted | NodeRejected | ClusterReady | Heartbeat | Shutdown

FRONT_END_SILENCE_S = 30  # an engine disconnects a front end that answers no ping for this long
COORDINATOR_LIMIT = 64 * 2**10
HANDSHAKE_LIMIT = 2**20


def engine_input_limit(max_model_len: int) -> int:
    """Largest frame an engine takes: an ``AddRequest`` of a full-length prompt, plus 2 MiB
    for its id and sampling params (the API bounds stop strings to ~256 KiB of them, a
    constraint to 256 KiB, allowed_token_ids to 64 Ki ids)."""
    return 9 * max_model_len + 2**21


def error_text(error: Exception) -> str:
    """A decode error for a log line: one short line, whatever bytes the sender put in it."""
    text = str(error).encode("unicode_escape").decode("ascii")
    return text if len(text) <= 300 else text[:300] + "..."


def decode_routed(frames: list[bytes], decoder: msgspec.msgpack.Decoder, log, what: str = "message"):
    """(identity, message) from the frames a ROUTER received, or None after one warning line
    saying why they were dropped (the wrong frame count, undecodable, the wrong type)."""
    if len(frames) != 2:
        log.warning("dropped a %s of %d frames (expected identity + payload)", what, len(frames))
        return None
    identity, payload = frames
    try:
        return identity, decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("dropped a malformed %s (%d bytes): %s", what, len(payload), error_text(exc))
        return None


encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
to_coordinator_decoder = msgspec.msgpack.Decoder(ToCoordinator)
loads_decoder = msgspec.msgpack.Decoder(LoadSnapshot)
to_head_decoder = msgspec.msgpack.Decoder(ToHead)
from_head_decoder = msgspec.msgpack.Decoder(FromHead)
