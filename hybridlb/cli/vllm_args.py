"""`vllm serve` command lines, accepted by `hybridlb serve`.

Users arrive with vLLM command lines (their own, vLLM's data-parallel deployment docs,
llm-d manifests). ``translate`` rewrites one into hybridlb's flags before the CLI parses
it: the positional model, vLLM's short forms, underscores for dashes, the load-balancing
switches, ``k``/``K`` length suffixes and vLLM's dtype names. A vLLM flag whose meaning
hybridlb does not implement is an error that names it and says what to do; one that has
nothing to change here (``--trust-remote-code``: no checkpoint code ever runs) is accepted
with a note. Nothing is silently given another meaning.
"""

from __future__ import annotations

import re

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
QUANTIZATIONS = ("int8", "int4", "gguf")  # engine.quantization; any other method is vLLM's alone
LENGTHS = {"--max-model-len", "--max-num-batched-tokens"}
SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}

# Flags (without a value) that change nothing here, and why.
NO_EFFECT = {
    "--trust-remote-code": "hybridlb never runs code from a checkpoint; its model code is its own",
    "--disable-log-requests": "hybridlb does not log request contents",
    "--no-enable-log-requests": "hybridlb does not log request contents",
    "--disable-log-stats": "hybridlb logs no periodic stats (read /metrics)",
    "--disable-uvicorn-access-log": "hybridlb's HTTP server keeps no access log",
    "--enable-dbo": "dual-batch overlap selects GPU kernels hybridlb does not have",
}
# Flags with a value, the values that change nothing here, and why.
NO_EFFECT_VALUES = {
    "--tensor-parallel-size": ({"1"}, "one device per engine is all hybridlb runs"),
    "--pipeline-parallel-size": ({"1"}, "one device per engine is all hybridlb runs"),
    "--data-parallel-backend": ({"mp"}, "`hybridlb serve` runs plain processes"),
    "--kv-cache-dtype": ({"auto"}, "the KV cache is held in the model's dtype"),
    "--uvicorn-log-level": (None, "set the log level with HYBRIDLB_LOG_LEVEL"),
    "--disable-access-log-for-endpoints": (None, "hybridlb's HTTP server keeps no access log for any endpoint"),
    "--all2all-backend": (None, "it selects GPU all-to-all kernels hybridlb does not have (experts use "
                                "torch.distributed collectives)"),
    "--moe-backend": (None, "it selects GPU MoE kernels hybridlb does not have"),
    "--dbo-decode-token-threshold": (None, "dual-batch overlap selects GPU kernels hybridlb does not have"),
}
# vLLM features hybridlb does not implement: what to do instead.
UNSUPPORTED = {
    "--tensor-parallel-size": "tensor parallelism is not implemented (one device per engine); scale with "
                              "data parallelism (--data-parallel-size) or drop the flag",
    "--pipeline-parallel-size": "pipeline parallelism is not implemented; drop the flag",
    "--data-parallel-backend": "only `mp` here; for Ray use `hybridlb up config.yaml`",
    "--kv-cache-dtype": "the KV cache is kept in the model's dtype; drop the flag",
    "--kv-transfer-config": "disaggregated prefill/decode (KV transfer) is not implemented; drop the flag",
    "--fully-sharded-loras": "LoRA layers are not sharded here (one device per engine); drop the flag",
    "--lora-dtype": "adapters run in the model's dtype; drop the flag",
    "--enable-eplb": "expert-parallel load balancing (EPLB) is not implemented; drop the flag",
    "--eplb-config": "expert-parallel load balancing (EPLB) is not implemented; drop the flag",
    "--async-scheduling": "hybridlb's engine schedules in its own loop; drop the flag",
    "--compilation-config": "hybridlb does not compile the model; drop the flag",
    "--tokenizer": "the tokenizer is the checkpoint's own; drop the flag",
    "--revision": "nothing is downloaded: give a local checkpoint; drop the flag",
    "--download-dir": "nothing is downloaded: give a local checkpoint; drop the flag",
    "--load-format": "checkpoints load from safetensors or GGUF; drop the flag",
    "--distributed-executor-backend": "one device per engine: no executor backend; drop the flag",
    "--swap-space": "preempted requests are recomputed, not swapped; drop the flag",
    "--cpu-offload-gb": "weights are not offloaded; drop the flag",
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
    """``serve`` arguments in vLLM's spelling → (hybridlb's spelling, notes for the user)."""
    out, notes, problems = [], [], []
    lb_mode = None
    cursor = _Cursor(args)
    if args and not args[0].startswith("-"):  # vllm serve MODEL ...
        out += ["--model", cursor.next()]
    while (arg := cursor.next()) is not None:
        if not arg.startswith("-") or arg == "--":
            out.append(arg)
            continue
        flag, equals, inline = arg.partition("=")
        inline = inline if equals else None
        flag = SHORT.get(flag, flag)
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")
        flag = RENAMED.get(flag, flag)
        if flag in LB_SWITCHES:
            if lb_mode not in (None, LB_SWITCHES[flag]):
                problems.append(f"{flag} cannot be combined with {LB_FLAG[lb_mode]}; give one load-balancing mode")
            lb_mode = LB_SWITCHES[flag]
        elif flag == "--lb-mode":
            given = (cursor.value(inline) or "").replace("-", "_")
            if lb_mode not in (None, given):
                problems.append(f"--lb-mode {given} cannot be combined with {LB_FLAG.get(lb_mode, lb_mode)}; "
                                "give one load-balancing mode")
            lb_mode = given
        elif flag in NO_EFFECT:
            notes.append(f"{flag} has no effect: {NO_EFFECT[flag]}")
        elif flag in NO_EFFECT_VALUES:
            given = cursor.value(inline)
            allowed, why = NO_EFFECT_VALUES[flag]
            if allowed is None or given in allowed:
                notes.append(f"{flag} {given} has no effect: {why}")
            else:
                problems.append(f"{flag} {given}: {UNSUPPORTED[flag]}")
        elif flag in UNSUPPORTED:
            cursor.value(inline)
            problems.append(f"{flag}: {UNSUPPORTED[flag]}")
        elif flag in ("--served-model-name", "--lora-modules"):  # vLLM takes several values after one flag
            values = [inline] if inline is not None else []
            while (value := cursor.value(None)) is not None:
                values.append(value)
            if not values:
                problems.append(f"{flag}: give at least one " + ("name" if flag == "--served-model-name" else
                                                                 "adapter (name=path)"))
            out += [part for value in values for part in (flag, value)]
        elif flag == "--dtype":
            given = cursor.value(inline)
            if given in DTYPES:
                out += [flag, DTYPES[given]]
            else:
                problems.append(f"--dtype {given}: use one of {', '.join(DTYPES)}")
        elif flag == "--quantization":
            given = cursor.value(inline)
            if given in QUANTIZATIONS:
                out += [flag, given]
            elif given not in ("none", "None"):
                problems.append(f"--quantization {given}: hybridlb keeps weights quantized as one of "
                                f"{', '.join(QUANTIZATIONS)} (CPU); serve the unquantized checkpoint with one of them, "
                                "or drop the flag")
        elif flag in LENGTHS:
            given = cursor.value(inline)
            try:
                out += [flag, str(parse_length(given))]
            except ValueError as exc:
                problems.append(f"{flag} {given}: {exc}")
        else:
            out.append(flag if inline is None else f"{flag}={inline}")
    if lb_mode is not None:
        out += ["--lb-mode", lb_mode]
    elif "--data-parallel-size-local" in {word.partition("=")[0] for word in out}:
        notes.append("no load-balancing flag: vLLM would run internal LB across nodes, hybridlb runs hybrid LB "
                     "(an API server on every node, balancing its own ranks); pass --lb-mode internal for "
                     "vLLM's behaviour")
    if problems:
        raise FlagError("hybridlb serve cannot take these vLLM flags as given:\n  " + "\n  ".join(problems))
    return out, notes


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
