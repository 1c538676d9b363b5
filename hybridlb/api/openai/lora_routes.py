"""vLLM's runtime LoRA endpoints, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(present only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set, as in vLLM): their bodies and
errors. What they change is the server's ``AdapterRegistry`` (``hybridlb.api.dispatch.lora``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

import msgspec
from fastapi import Request
from fastapi.responses import PlainTextResponse

from hybridlb.api.dispatch.lora import AdapterRegistry
from hybridlb.api.errors import APIError
from hybridlb.checkpoint.lora import AdapterError

NAME = re.compile(r"[^\s,]{1,128}")  # names are joined with commas in vllm:lora_requests_info


class LoadLoRAAdapter(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: Annotated[str, msgspec.Meta(max_length=4096)]  # PATH_MAX: error messages quote it
    load_inplace: bool = False  # replace an adapter of the same name (vLLM's flag)


class UnloadLoRAAdapter(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM accepts it; names identify adapters here


async def _body(request: Request, kind: type):
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise APIError(400, f"invalid request body: {exc}") from None


async def load_lora_adapter(request: Request):
    ctx = request.app.state.context
    registry: AdapterRegistry = ctx.adapters
    body = await _body(request, LoadLoRAAdapter)
    if not registry.enabled:
        raise APIError(400, "this server serves no LoRA adapters; start it with --enable-lora")
    if not body.lora_name.strip() or not body.lora_path.strip():
        raise APIError(400, "both 'lora_name' and 'lora_path' must be provided", param="lora_name")
    if not NAME.fullmatch(body.lora_name):
        raise APIError(400, "lora_name must be 1 to 128 characters without spaces or commas", param="lora_name")
    if body.lora_name in ctx.served_names:
        raise APIError(400, f"'{body.lora_name}' is the base model's name; give the adapter another", param="lora_name")
    if body.lora_name in registry.adapters and not body.load_inplace:
        raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load the "
                            "adapter in place, set 'load_inplace' to True.", param="lora_name")
    try:  # reading the header and config touches the disk: not on the event loop
        adapter = await asyncio.to_thread(registry.load, body.lora_name, body.lora_path)
    except AdapterError as exc:
        raise APIError(400, f"adapter '{body.lora_name}': {exc}", param="lora_path") from None
    if registry.eager:
        for engine in ctx.pool.engines:
            engine.load_adapters([adapter.request])
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request):
    ctx = request.app.state.context
    registry: AdapterRegistry = ctx.adapters
    body = await _body(request, UnloadLoRAAdapter)
    if registry.adapters.pop(body.lora_name, None) is None:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                       code="not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


RUNTIME_ROUTES = (
    ("/v1/load_lora_adapter", ["POST"], load_lora_adapter),
    ("/v1/unload_lora_adapter", ["POST"], unload_lora_adapter),
)
