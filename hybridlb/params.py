"""What a request asks of the engines: its sampling parameters, with the grammar its output
must match (``Constraint``) and the LoRA adapter it runs with (``LoRARequest``). Shared by the
offline API, the HTTP server and the wire (``AddRequest.params``, ``hybridlb.protocol``)."""

from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20  # most alternatives a request may ask for per position (vLLM's default)
MAX_LOGIT_BIAS = 1024  # token ids one request may bias


MAX_CONSTRAINT_CHARS = 256 * 2**10  # a grammar, schema or regex (the engine compiles it)
MAX_ALLOWED_TOKEN_IDS = 2**16
MAX_BAD_WORDS = 256  # token sequences one request may ban
# Tokens of one banned sequence: a word or phrase is a few; with MAX_BAD_WORDS this bounds a
# request's bad words to 64 Ki token ids (~330 KB on the wire, well inside the engine's limit).
MAX_BAD_WORD_TOKENS = 256
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


class Constraint(msgspec.Struct, omit_defaults=True):
    """What a request's output must match (structured outputs), compiled by the engine's grammar
    backend (``hybridlb.grammar``): ``json`` a JSON schema (JSON text; ``{"type": "object"}``
    for JSON mode), ``regex``, ``choice`` (a JSON list of strings), ``grammar`` (Lark, or GBNF
    EBNF) or ``structural_tag`` (vLLM's JSON form). ``after``: token ids that start the
    constrained part (a reasoning model's end-of-thinking marker); empty: from the first token.
    ``opener`` (with ``after``): the start-of-thinking marker's ids, for models that may or may
    not think (Qwen3): the first token may be the grammar's or the opener's first; one that
    starts the opener must complete it, and the grammar then waits for ``after``; any other
    starts the constrained part at once."""

    kind: str
    value: str
    after: list[int] = msgspec.field(default_factory=list)
    opener: list[int] = msgspec.field(default_factory=list)
    # None: the engine's structured_outputs setting; True/False: this request's choice.
    compact: bool | None = None  # JSON without whitespace between tokens (disable_any_whitespace)
    closed: bool | None = None  # objects listing properties allow no others (disable_additional_properties)

    def problem(self) -> str | None:
        if self.kind not in CONSTRAINT_KINDS:
            return f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}"
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            return f"a constraint may hold at most {MAX_CONSTRAINT_CHARS} characters, got {len(self.value)}"
        return None


class LoRARequest(msgspec.Struct, frozen=True):
    """The LoRA adapter a request runs with: the name it was registered under, its directory
    (``hybridlb.checkpoint.lora``) and its weights file's modification time (ns). Engines hold
    adapters by all three: a name that comes with another path or version is the adapter
    reloaded (vLLM's load_inplace)."""

    name: str
    path: str
    version: int = 0

    @property
    def key(self) -> str:
        """What names this adapter's KV blocks (``prefix_hash.adapter_seed``)."""
        return f"{self.name}\0{self.path}\0{self.version}"


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """How to sample one request; shared by the offline API, the HTTP server and the wire.

    ``stop`` strings are applied where text exists (the detokenizer of the front end or
    the offline API), which then aborts the request in the engine. The engine handles
    token-level stops: eos, ``stop_token_ids``, ``max_tokens`` and the model length.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    # OpenAI's: subtract presence_penalty from the logit of every token already generated, and
    # frequency_penalty times the number of times it was (output tokens only, as vLLM).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> added to its logit
    # Log-probabilities (the model's own, before penalties and temperature) of each sampled
    # token with this many most likely alternatives; prompt_logprobs the same for every prompt
    # token after the first. None: not computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None  # structured outputs
    lora: LoRARequest | None = None  # the adapter this request runs with (None: the base model)
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many tokens are out
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[list[int]] = msgspec.field(default_factory=list)  # token sequences never to complete
    # Where text exists (the front end, the offline API): stop strings kept in the output, and
    # special tokens' text shown (skip_special_tokens=False).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def problems(self) -> list[tuple[str, str]]:
        """Every invalid field as (name, message); empty when the params are usable."""
        found = []
        if self.max_tokens is not None and self.max_tokens < 1:
            found.append(("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"))
        if self.temperature < 0:
            found.append(("temperature", f"temperature must be >= 0, got {self.temperature}"))
        if not 0 < self.top_p <= 1:
            found.append(("top_p", f"top_p must be in (0, 1], got {self.top_p}"))
        if self.top_k < 0:
            found.append(("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k}"))
        if not 0 < self.repetition_penalty <= 100:
            found.append(("repetition_penalty",
                          f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}"))
        if any(not s for s in self.stop):
            found.append(("stop", "stop strings must not be empty"))
        if any(t < 0 for t in self.stop_token_ids):
            found.append(("stop_token_ids", "stop_token_ids must be non-negative"))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                found.append((name, f"{name} must be in [-2, 2], got {getattr(self, name)}"))
        if not 0 <= self.min_p <= 1:
            found.append(("min_p", f"min_p must be in [0, 1], got {self.min_p}"))
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            found.append(("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, each biased by a "
                                        "value in [-100, 100]"))
        if any(t < 0 for t in self.logit_bias):
            found.append(("logit_bias", "logit_bias token ids must be non-negative"))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                found.append((name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}"))
        if self.constraint is not None and (problem := self.constraint.problem()):
            found.append(("structured_outputs", problem))
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            found.append(("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"))
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                found.append(("allowed_token_ids", f"allowed_token_ids needs 1 to {MAX_ALLOWED_TOKEN_IDS} token ids"))
            elif min(self.allowed_token_ids) < 0:
                found.append(("allowed_token_ids", "allowed_token_ids must be non-negative"))
        if len(self.bad_words) > MAX_BAD_WORDS or any(not w or min(w) < 0 for w in self.bad_words):
            found.append(("bad_words", f"bad_words takes at most {MAX_BAD_WORDS} non-empty words"))
        elif any(len(w) > MAX_BAD_WORD_TOKENS for w in self.bad_words):
            found.append(("bad_words", f"a bad word may be at most {MAX_BAD_WORD_TOKENS} tokens long"))
        return found

    def out_of_vocab(self, vocab_size: int) -> tuple[str, str] | None:
        """The first field naming a token id outside ``[0, vocab_size)``, as (field, message), if any:
        every such id indexes the logits, where one out of range fails the whole step."""
        markers = [*self.constraint.after, *self.constraint.opener] if self.constraint is not None else []
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", [t for word in self.bad_words for t in word]),
                          ("structured_outputs", markers)):
            if any(not 0 <= token < vocab_size for token in ids):
                return name, f"{name} token ids must be in [0, {vocab_size})"
        return None
