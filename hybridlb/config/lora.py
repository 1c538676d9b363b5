"""The ``engine.lora`` section: LoRA adapters, with vLLM's ``--enable-lora`` flags."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from hybridlb.config.base import _Section, raise_all
from hybridlb.config.flags import flag


class LoRAModuleConfig(_Section):
    """One LoRA adapter served from the start (vLLM's --lora-modules entry)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[^\s,]+$",
                      description="The name requests give as `model` (no spaces or commas).")
    path: str = Field(min_length=1, description="The adapter directory (peft's save_pretrained: "
                      "adapter_config.json + adapter_model.safetensors).")
    base_model_name: str | None = Field(None, description="The `parent` /v1/models shows; default: the first "
                                        "served model name.")


class LoRAConfig(_Section):
    """LoRA adapters (vLLM's --enable-lora and its options): requests name an adapter in `model`;
    requests for different adapters and for the base model share one batch."""

    modules: list[LoRAModuleConfig] = Field(
        default_factory=list, description="Adapters served from the start; more can be loaded at run time "
        "(docs/lora.md).", json_schema_extra=flag(
            "--lora-modules", vllm=True, parse="name=path", note="Each name=path, or JSON {\"name\", \"path\", "
            "\"base_model_name\"}; repeat the flag, or list several after it as vLLM does."))
    max_loras: int = Field(1, ge=1, le=64, description="Adapters one engine holds at once (one batch mixes at most "
                           "this many); loading another evicts the least recently used idle one.",
                           json_schema_extra=flag(vllm=True))
    max_lora_rank: int = Field(16, ge=1, le=512, description="Highest adapter rank accepted (slots are sized to it).",
                               json_schema_extra=flag(vllm=True))
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters an engine keeps read in memory, held or "
                                      "not (default: max_loras); must be at least max_loras.",
                                      json_schema_extra=flag(vllm=True))
    load: Literal["lazy", "eager"] = Field(
        "lazy", description="When engines read an adapter: lazy, when a request first needs it; eager, as soon as it "
                            "is registered (at start-up, or by /v1/load_lora_adapter), each engine reading it into "
                            "memory and into a free slot (none is evicted for it).",
        json_schema_extra=flag("--lora-load"))
    allowed_roots: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, description="Directories clients may load adapters from at run time (/v1/load_lora_adapter, with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): a path is resolved (symlinks, ..) and must lie inside one. Default: "
        "the directories holding the modules' adapters; with neither, runtime loading refuses every path. "
        "Every path problem gets one error text, so clients cannot map the server's files (docs/lora.md).",
        json_schema_extra=flag("--lora-allowed-root", note="Repeat it for several."))

    @model_validator(mode="after")
    def _check(self) -> LoRAConfig:
        problems = []
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            problems.append(f"max_cpu_loras ({self.max_cpu_loras}) is below max_loras ({self.max_loras}); raise it "
                            "or leave it unset")
        names = [m.name for m in self.modules]
        if len(set(names)) < len(names):
            problems.append(f"lora modules name {sorted({n for n in names if names.count(n) > 1})} twice; give "
                            "each adapter its own name")
        raise_all(problems)
        return self

    @property
    def cpu_slots(self) -> int:
        return self.max_cpu_loras or self.max_loras
