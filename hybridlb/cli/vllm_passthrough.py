"""vLLM's engine flags handed to vLLM's engine, with ``--engine-backend vllm`` (``vllm_args``).

With that backend each rank runs vLLM's own engine core, so a vLLM flag that hybridlb's engine
would refuse or ignore (``-tp 2``, ``--kv-cache-dtype fp8``, ``--quantization awq``,
``--trust-remote-code``) means what it means in ``vllm serve``: it goes into
``engine.vllm_args``, the keyword arguments of vLLM's ``EngineArgs``. The rules:

* The key is the flag's name without its dashes, dashes made underscores
  (``--tensor-parallel-size`` → ``tensor_parallel_size``); a dotted flag sets a key inside
  one (``--compilation-config.mode 3`` → ``{"compilation_config": {"mode": 3}}``).
* The value: a switch with no value is ``True`` and its ``--no-`` form ``False``
  (``--no-enable-chunked-prefill`` → ``{"enable_chunked_prefill": false}``); any other value
  is read as JSON where it is JSON (``2``, ``0.5``, ``true``, ``{...}``, ``[...]``), else
  kept as text. A value that must stay text although it reads as JSON (a numeric revision)
  goes in ``--vllm-args`` as a JSON string.
* vLLM's ``-O3`` is its optimization level (``optimization_level``); ``-O.mode=3`` is
  ``--compilation-config.mode=3``. vLLM's short forms ``-cc``, ``-ac``, ``-sc``, ``-dc``,
  ``-dcp``, ``-pcp`` are expanded.
* A long flag ``serve`` does not know is taken as one of vLLM's and handed over too: vLLM's
  ``EngineArgs`` refuses a name it does not know when the engines start, naming it. Such a flag
  takes the next word as its value unless that word is another flag.
* An explicit ``--vllm-args JSON`` is merged with the flags, and its keys win over theirs (the
  JSON is the exact statement of what vLLM gets; a note names any flag it overrides).

hybridlb's own flags keep their meaning (data parallelism, load balancing, the API servers,
the launcher, and the engine options hybridlb maps onto vLLM's: ``--dtype``,
``--max-model-len``, ``--max-num-seqs``, ``--enable-prefix-caching``, ``--enable-lora``,
``--seed``, ``--block-size`` ...). So do the API-server and logging flags that change nothing
(notes), ``--data-parallel-backend`` (the launcher's matter) and ``--kv-transfer-config`` (not
implemented). The backend is seen by a pre-scan of the command line (``--engine-backend
vllm``, the last one given, as the parser takes it): a config file's ``engine.backend`` is not
read here, so with only the file saying vllm, vLLM's flags are treated as for hybridlb's engine.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM's engine switches that hybridlb's own engine takes as changing nothing (vllm_args.NO_EFFECT).
SWITCHES = {"--trust-remote-code", "--enable-dbo", "--fully-sharded-loras", "--enable-eplb", "--async-scheduling"}
# vLLM's engine flags with a value that hybridlb's own engine ignores or refuses (NO_EFFECT_VALUES, REFUSED).
VALUED = {"--tensor-parallel-size", "--pipeline-parallel-size", "--kv-cache-dtype", "--lora-dtype", "--load-format",
          "--download-dir", "--all2all-backend", "--moe-backend", "--dbo-decode-token-threshold", "--eplb-config",
          "--compilation-config", "--distributed-executor-backend", "--swap-space", "--cpu-offload-gb",
          "--optimization-level"}
# vLLM's short forms that hybridlb's own spelling does not expand (vllm_args.SHORT does the rest).
SHORT = {"-cc": "--compilation-config", "-ac": "--attention-config", "-sc": "--speculative-config",
         "-dc": "--diffusion-config", "-dcp": "--decode-context-parallel-size",
         "-pcp": "--prefill-context-parallel-size"}
OWN_QUANTIZATIONS = ("int8", "int4", "gguf", "none", "None")  # hybridlb reads these itself (vllm_args.take_value)


def wants_vllm(args: list[str], spelt) -> bool:
    """Whether the command line asks for ``--engine-backend vllm`` (the last one given wins, as
    when parsing); ``spelt`` turns a flag into hybridlb's spelling (underscores → dashes)."""
    backend = None
    for at, arg in enumerate(args):
        if arg == "--":
            break
        flag, equals, inline = arg.partition("=")
        if arg.startswith("--") and spelt(flag) == "--engine-backend":
            backend = inline if equals else (args[at + 1] if at + 1 < len(args) else None)
    return backend == "vllm"


def o_flag(arg: str) -> str:
    """vLLM's ``-O`` forms in long spelling: ``-O3``/``-O=3``/``-O`` are the optimization level,
    ``-O.key=value`` a key of the compilation config."""
    rest = arg[2:]
    if rest.startswith("."):
        return "--compilation-config" + rest
    return "--optimization-level" + ("" if not rest else rest if rest.startswith("=") else "=" + rest)


def typed(text: str) -> Any:
    """A flag's value as vLLM's engine takes it: JSON where it is JSON (2, 0.5, true, {...}), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def key_path(flag: str) -> list[str]:
    """``--compilation-config.mode`` → ``["compilation_config", "mode"]``."""
    return [part.replace("-", "_") for part in flag.lstrip("-").split(".")]


def _switch(flag: str) -> bool:
    """One of SWITCHES, or its --no- form."""
    return flag in SWITCHES or "--" + flag.removeprefix("--no-") in SWITCHES


def _sets(args: dict, path: list[str]) -> bool:
    """Whether ``args`` sets the key at ``path`` (a dict at its top: the keys inside)."""
    for key in path:
        if not isinstance(args, dict) or key not in args:
            return False
        args = args[key]
    return True


def merged(into: dict, update: dict) -> dict:
    """``into`` with ``update``'s keys set over it, dicts merged key by key."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merged(into[key], value)
        else:
            into[key] = value
    return into


class Passthrough:
    """The vLLM flags of one command line that go to vLLM's engine (``--vllm-args``)."""

    def __init__(self):
        self.args: dict[str, Any] = {}
        self.given: list[tuple[str, list[str]]] = []  # (the flag as written here, the keys it sets)
        self.explicit: list[str] = []  # the --vllm-args values given

    @staticmethod
    def takes(flag: str) -> bool:
        """Whether ``flag`` is one of vLLM's engine flags that hybridlb's own engine ignores or refuses
        (a flag ``serve`` does not know at all is the caller's to hand over)."""
        return _switch(flag) or flag.partition(".")[0] in VALUED

    def add(self, flag: str, inline: str | None, cursor) -> str | None:
        """Take ``flag`` (its value from ``inline`` or the cursor); a problem, or None."""
        given = inline if inline is not None or _switch(flag) else cursor.value(None)
        if given is None and flag.partition(".")[0] in VALUED:
            return f"{flag}: give it a value (vLLM's engine argument {key_path(flag)[0]})"
        if given is None and flag.startswith("--no-"):
            path, value, shown = key_path("--" + flag.removeprefix("--no-")), False, flag
        else:
            path, value = key_path(flag), True if given is None else typed(given)
            shown = flag if given is None else f"{flag} {given}"
        for key in reversed(path[1:]):
            value = {key: value}
        merged(self.args, {path[0]: value})
        self.given.append((shown, path))
        return None

    def add_quantization(self, method: str) -> None:
        merged(self.args, {"quantization": method})
        self.given.append((f"--quantization {method}", ["quantization"]))

    def finish(self, out: list[str], notes: list[str]) -> None:
        """Append ``--vllm-args JSON`` to ``out`` (the flags' keys under the explicit ``--vllm-args``)
        and a note saying what went to vLLM."""
        if not self.given and not self.explicit:
            return
        explicit: dict[str, Any] = {}
        for text in self.explicit:
            value = typed(text)
            if not isinstance(value, dict):  # not a JSON object: as given, for the config options to refuse
                out += ["--vllm-args", text]
                return
            merged(explicit, value)
        out += ["--vllm-args", json.dumps(merged(self.args, explicit))]
        if self.given:
            notes.append("handed to vLLM's engine: " + ", ".join(shown for shown, _ in self.given)
                         + " (engine.vllm_args)")
        overridden = [shown for shown, path in self.given if _sets(explicit, path)]
        if overridden:
            notes.append(f"--vllm-args sets these itself, and its values are the ones used: {', '.join(overridden)}")
