"""`vllm serve` command lines, accepted by `hybridlb serve`.

Users arrive with vLLM command lines (their own, vLLM's data-parallel deployment docs,
llm-d manifests). ``translate`` rewrites one into hybridlb's flags before the CLI parses
it: the positional model, vLLM's short forms, underscores for dashes, the load-balancing
switches, ``k``/``K`` length suffixes and vLLM's dtype names. A vLLM flag that changes
nothing here (``--trust-remote-code``: no checkpoint code ever runs; ``--swap-space``:
preempted requests are recomputed) is accepted with a note saying why. One whose meaning
hybridlb would change, so that it would serve something other than what was asked
(``-tp 2``, ``--kv-transfer-config``), is a problem that names it and says what to do;
``translate_all`` returns every problem of the line, for the CLI to list with the config's.
Nothing is silently given another meaning. With ``--engine-backend vllm`` each rank runs
vLLM's own engine, and vLLM's engine flags that hybridlb's engine would refuse or ignore, and
any long flag ``serve`` does not know, are handed to it (``--vllm-args``): ``vllm_passthrough``
gives the rules.
"""

from __future__ import annotations

import difflib
import re

from hybridlb.cli.vllm_passthrough import OWN_QUANTIZATIONS, Passthrough, o_flag, wants_vllm
from hybridlb.cli.vllm_passthrough import SHORT as VLLM_SHORT

SHORT = {
    "-dp": "--data-parallel-size", "-dpl": "--data-parallel-size-local", "-dpr": "--data-parallel-start-rank",
    "-dpn": "--data-parallel-rank", "-dpa": "--data-parallel-address", "-dpp": "--data-parallel-rpc-port",
    "-dpb": "--data-parallel-backend", "-dph": "--data-parallel-hybrid-lb", "-dpe": "--data-parallel-external-lb",
    "-dpm": "--data-parallel-multi-port-external-lb",
    "-ep": "--enable-expert-parallel", "-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
    "-q": "--quantization", "-O": "--compilation-config",
}
RENAMED = {"--api-server-count": "--api-servers-per-node"}
LB_FLAG = {"hybrid": "--data-parallel-hybrid-lb", "external": "--data-parallel-external-lb",
           "multi_port": "--data-parallel-multi-port-external-lb", "internal": "--lb-mode internal"}
LB_SWITCHES = {"--data-parallel-hybrid-lb": "hybrid", "--data-parallel-external-lb": "external",
               "--data-parallel-multi-port-external-lb": "multi_port"}
DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
          "float32": "float32"}
QUANTIZATIONS = ("int8", "int4", "gguf")  # engine.quantization (or none); any other method is vLLM's alone
LENGTHS = {"--max-model-len", "--max-num-batched-tokens"}
SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}

ONE_DEVICE = "one device per engine is all hybridlb runs"
EPLB = ("expert-parallel load balancing (EPLB) only moves experts between ranks for speed; here each rank keeps "
        "its experts, with the same outputs")
ANY = "*"  # in NO_EFFECT_VALUES: whatever the value
# Switches (no value) that change nothing here, and why; their --no- forms change nothing either.
NO_EFFECT = {
    "--trust-remote-code": "hybridlb never runs code from a checkpoint; its model code is its own",
    "--disable-log-requests": "hybridlb does not log request contents",
    "--no-enable-log-requests": "hybridlb does not log request contents",
    "--disable-log-stats": "hybridlb logs no periodic stats (read /metrics)",
    "--disable-uvicorn-access-log": "hybridlb's HTTP server keeps no access log",
    "--enable-dbo": "dual-batch overlap selects GPU kernels hybridlb does not have",
    "--fully-sharded-loras": "it shards LoRA layers under tensor parallelism, and " + ONE_DEVICE,
    "--enable-eplb": EPLB,
    "--async-scheduling": "it overlaps scheduling with the forward pass for speed; hybridlb's engine schedules in "
                          "its own loop, with the same outputs",
}
# Flags with a value: the values that change nothing here, and why (ANY: every value). Another
# value would make hybridlb serve something other than what was asked: REFUSED says what to do.
NO_EFFECT_VALUES = {
    "--tensor-parallel-size": {"1": ONE_DEVICE},
    "--pipeline-parallel-size": {"1": ONE_DEVICE},
    "--data-parallel-backend": {"mp": "`hybridlb serve` runs plain processes",
                                "ray": "`hybridlb serve` runs this node's ranks as processes here; `hybridlb up "
                                       "config.yaml` is the Ray path (Ray places every rank)"},
    "--kv-cache-dtype": {"auto": "the KV cache is held in the model's dtype"},
    "--lora-dtype": {"auto": "adapters run in the model's dtype"},
    "--load-format": dict.fromkeys(("auto", "safetensors", "gguf"), "checkpoints load from their own safetensors "
                                                                    "or GGUF files"),
    "--disable-access-log-for-endpoints": {ANY: "hybridlb's HTTP server keeps no access log for any endpoint"},
    "--all2all-backend": {ANY: "it selects GPU all-to-all kernels hybridlb does not have (experts use "
                               "torch.distributed collectives)"},
    "--moe-backend": {ANY: "it selects GPU MoE kernels hybridlb does not have"},
    "--dbo-decode-token-threshold": {ANY: "dual-batch overlap selects GPU kernels hybridlb does not have"},
    "--eplb-config": {ANY: EPLB},
    "--compilation-config": {ANY: "hybridlb does not compile the model (a bfloat16 dense model replays its decode "
                                  "steps as one recorded call; --enforce-eager turns that off)"},
    "--distributed-executor-backend": {ANY: "each engine is one process on one device: there is no executor "
                                            "to choose"},
    "--swap-space": {ANY: "preempted requests are recomputed, not swapped to CPU memory: the same outputs"},
    "--cpu-offload-gb": {ANY: "weights are not offloaded: all of them go on the engine's device (a model that "
                              "needs the offload runs out of memory as it loads)"},
}
# What hybridlb would serve differently from what the flag (or its value) asks: what to do instead.
REFUSED = {
    "--tensor-parallel-size": "tensor parallelism is not implemented (one device per engine); scale with "
                              "data parallelism (--data-parallel-size) or drop the flag",
    "--pipeline-parallel-size": "pipeline parallelism is not implemented; drop the flag",
    "--data-parallel-backend": "vLLM's backends are mp and ray; `hybridlb serve` runs processes, `hybridlb up "
                               "config.yaml` places ranks on Ray",
    "--kv-cache-dtype": "the KV cache is kept in the model's dtype (other precision, fewer tokens per GiB than "
                        "asked); size it with --kv-cache-gib and drop the flag",
    "--lora-dtype": "adapters run in the model's dtype (choose it with --dtype); drop the flag",
    "--load-format": "checkpoints load from safetensors or GGUF files (random weights: write a checkpoint with "
                     "`hybridlb make-model`); drop the flag",
    "--kv-transfer-config": "disaggregated prefill/decode (KV transfer) is not implemented; drop the flag",
    "--download-dir": "nothing is downloaded, and a hub model comes from the local Hugging Face cache: point "
                      "HF_HUB_CACHE at that directory, or give the checkpoint's path; drop the flag",
}


class FlagError(ValueError):
    """vLLM flags that cannot be taken as they are; the message lists each with what to do."""


class _Cursor:
    """Walks the arguments; ``value`` takes an option's value (inline ``--flag=v`` or the next word)."""

    def __init__(self, args: list[str]):
        self.args, self.at = args, 0

    def next(self) -> str | None:
        if self.at == len(self.args):
            return None
        self.at += 1
        return self.args[self.at - 1]

    def value(self, inline: str | None) -> str | None:
        if inline is not None:
            return inline
        if self.at < len(self.args) and not _is_flag(self.args[self.at]):
            return self.next()
        return None


def translate(args: list[str]) -> tuple[list[str], list[str]]:
    """``serve`` arguments in vLLM's spelling → (hybridlb's spelling, notes); FlagError lists the problems."""
    out, notes, problems = translate_all(args)
    if problems:
        raise FlagError("hybridlb serve cannot take these vLLM flags as given:\n  " + "\n  ".join(problems))
    return out, notes


def translate_all(args: list[str], known: set[str] | None = None) -> tuple[list[str], list[str], list[str]]:
    """``serve`` arguments in vLLM's spelling → (hybridlb's spelling, notes for the user, problems).

    A flag with a problem is left out of hybridlb's spelling, so the rest can still be checked and
    every problem listed at once. ``known``: the flags ``serve`` takes; any other is a problem too."""
    line = _Translation(args, known)
    line.run()
    return line.out, line.notes, line.problems


class _Translation:
    """One command line being translated: what comes out, the notes and the problems."""

    def __init__(self, args: list[str], known: set[str] | None):
        self.cursor, self.known = _Cursor(args), known
        self.out: list[str] = []
        self.notes: list[str] = []
        self.problems: list[str] = []
        self.lb_mode: str | None = None
        self.vllm = Passthrough() if wants_vllm(args, _spelt) else None  # --engine-backend vllm
        if args and not args[0].startswith("-"):  # vllm serve MODEL ...
            self.out += ["--model", self.cursor.next()]

    def run(self) -> None:
        while (arg := self.cursor.next()) is not None:
            if not arg.startswith("-") or arg == "--":
                self.out.append(arg)
                continue
            if self.vllm is not None and arg.startswith("-O"):  # vLLM's own: the optimization level
                arg = o_flag(arg)
            elif arg.startswith("-O") and arg[2:3] not in ("", "="):  # vLLM's -O3, -O.mode=3: the compilation config
                arg = f"-O={arg[2:]}"
            flag, equals, inline = arg.partition("=")
            if self.vllm is not None:
                flag = VLLM_SHORT.get(flag, flag)
            self.take(_spelt(flag), inline if equals else None)
        self.finish()

    def take(self, flag: str, inline: str | None) -> None:
        """Translate one flag (its value, if any, still to be taken from the cursor)."""
        if flag in LB_SWITCHES:
            self.set_lb_mode(LB_SWITCHES[flag], flag)
        elif flag == "--lb-mode":
            given = (self.cursor.value(inline) or "").replace("-", "_")
            self.set_lb_mode(given, f"--lb-mode {given}")
        elif self.vllm is not None and flag == "--vllm-args":
            self.vllm.explicit.append(self.cursor.value(inline) or "")
        elif self.vllm is not None and self.vllm.takes(flag):
            self.hand_to_vllm(flag, inline)
        elif (why := _no_effect(flag)) is not None:
            self.notes.append(f"{flag} has no effect: {why}")
        elif flag in NO_EFFECT_VALUES:
            given = self.cursor.value(inline)
            whys = NO_EFFECT_VALUES[flag]
            why = whys.get(given or "", whys.get(ANY))
            if why is not None:
                self.notes.append(f"{flag} {given} has no effect: {why}")
            else:
                self.problems.append(f"{flag} {given}: {REFUSED[flag]}")
        elif flag in REFUSED:
            self.cursor.value(inline)
            self.problems.append(f"{flag}: {REFUSED[flag]}")
        elif flag in ("--served-model-name", "--lora-modules"):
            self.take_several(flag, inline)
        elif flag in ("--dtype", "--quantization") or flag in LENGTHS:
            self.take_value(flag, self.cursor.value(inline))
        elif self.known is not None and flag not in self.known:
            if self.vllm is not None and flag.startswith("--") and not self.ours(flag.partition(".")[0]):
                self.hand_to_vllm(flag, inline)  # one of vLLM's, for its EngineArgs to take or refuse
            else:
                self.cursor.value(inline)
                self.problems.append(_unknown(flag, self.known))
        else:
            self.out.append(flag if inline is None else f"{flag}={inline}")

    def hand_to_vllm(self, flag: str, inline: str | None) -> None:
        if (problem := self.vllm.add(flag, inline, self.cursor)) is not None:
            self.problems.append(problem)

    def ours(self, flag: str) -> bool:
        """Whether hybridlb gives ``flag`` (or the switch it negates) its own meaning."""
        return any(name in self.known or name in REFUSED or name in NO_EFFECT_VALUES or _no_effect(name)
                   for name in (flag, "--" + flag.removeprefix("--no-")))

    def set_lb_mode(self, mode: str, spelt: str) -> None:
        if self.lb_mode not in (None, mode):
            self.problems.append(f"{spelt} cannot be combined with {LB_FLAG.get(self.lb_mode, self.lb_mode)}; "
                                 "give one load-balancing mode")
        self.lb_mode = mode

    def take_several(self, flag: str, inline: str | None) -> None:
        """vLLM takes several values after one --served-model-name or --lora-modules."""
        values = [inline] if inline is not None else []
        while (value := self.cursor.value(None)) is not None:
            values.append(value)
        if not values:
            self.problems.append(f"{flag}: give at least one " + ("name" if flag == "--served-model-name" else
                                                                  "adapter (name=path)"))
        self.out += [part for value in values for part in (flag, value)]

    def take_value(self, flag: str, given: str | None) -> None:
        """A value written vLLM's way: its dtype names, its quantization methods, k/K lengths."""
        if flag == "--dtype":
            if given in DTYPES:
                self.out += [flag, DTYPES[given]]
            else:
                self.problems.append(f"--dtype {given}: use one of {', '.join(DTYPES)}")
        elif flag == "--quantization":
            if given in (*QUANTIZATIONS, "none"):
                self.out += [flag, given]
            elif self.vllm is not None and given is not None and given not in OWN_QUANTIZATIONS:
                self.vllm.add_quantization(given)  # a method of vLLM's own, for vLLM's engine
            elif given == "None":  # vLLM's unset: the default
                self.notes.append("--quantization None: left unset, as vLLM reads it (a .gguf file stays quantized); "
                                  "--quantization none serves the weights in --dtype")
            else:
                self.problems.append(f"--quantization {given}: hybridlb keeps weights quantized as one of "
                                     f"{', '.join(QUANTIZATIONS)} (CPU); serve the unquantized checkpoint with one of "
                                     "them, or drop the flag")
        else:
            try:
                self.out += [flag, str(parse_length(given))]
            except ValueError as exc:
                self.problems.append(f"{flag} {given}: {exc}")

    def finish(self) -> None:
        if self.vllm is not None:
            self.vllm.finish(self.out, self.notes)
        if self.lb_mode is not None:
            self.out += ["--lb-mode", self.lb_mode]
        elif "--data-parallel-size-local" in {word.partition("=")[0] for word in self.out}:
            self.notes.append("no load-balancing flag: vLLM would run internal LB across nodes, hybridlb runs hybrid "
                              "LB (an API server on every node, balancing its own ranks); pass --lb-mode internal "
                              "for vLLM's behaviour")


def _spelt(flag: str) -> str:
    """A flag as hybridlb spells it: short forms expanded, dashes for underscores, vLLM's renames."""
    flag = SHORT.get(flag, flag)
    if flag.startswith("--"):
        flag = "--" + flag[2:].replace("_", "-")
    return RENAMED.get(flag, flag)


def _no_effect(switch: str) -> str | None:
    """Why a switch, or its --no- form, changes nothing here (None: it is not one of NO_EFFECT)."""
    if switch.startswith("--no-") and switch not in NO_EFFECT:
        switch = "--" + switch.removeprefix("--no-")
    return NO_EFFECT.get(switch)


def _unknown(flag: str, known: set[str]) -> str:
    """The problem with a flag ``serve`` does not take, with the nearest one it does."""
    close = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.8)
    if close:
        return f"{flag}: hybridlb serve has no such flag; did you mean {close[0]}?"
    return (f"{flag}: hybridlb serve has no such flag (nor is it a vLLM flag hybridlb knows to change nothing "
            "here); drop it (`hybridlb serve --help` lists the flags)")


def parse_length(text: str | None) -> int:
    """A token count as vLLM writes it: 4096, 32k (32,000), 32K (32,768), 1.5k."""
    if text is None:
        raise ValueError("needs a value")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if not match:
        raise ValueError("not a token count: write e.g. 4096, 32k (32,000) or 32K (32,768)")
    number, suffix = match.groups()
    return int(float(number) * SIZE_SUFFIXES.get(suffix, 1)) if suffix else int(float(number))


def _is_flag(arg: str) -> bool:
    """Whether ``arg`` starts another option (a negative number is a value)."""
    return arg.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", arg)
