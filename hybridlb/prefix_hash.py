"""Block hashes for prefix caching, computed the same way by engines and API servers.

A full KV block is named by a hash chained over its parent block's hash and its own
token ids, so two sequences share a block's hash exactly when they share every token up
to the block's end. The chain starts from a seed that names everything else that changes
the KV (the checkpoint), so blocks of different models never match. Hashes are unsigned
64-bit integers: they fit KV-cache events and msgpack as plain ints.

No torch here: the API server hashes prompts to route them (``cache_aware``).
"""

from __future__ import annotations

import hashlib
from array import array


def hash_seed(model: str) -> int:
    """The chain's first parent for blocks of ``model`` (the checkpoint path or name)."""
    return int.from_bytes(hashlib.blake2b(model.encode(), digest_size=8).digest(), "big")


def adapter_seed(seed: int, key: str) -> int:
    """The chain's first parent for a request run with the LoRA adapter ``key`` (LoRARequest.key)
    on the model whose seed is ``seed``: an adapter's KV blocks never match the base model's or
    another adapter's."""
    return block_hash(seed, list(f"lora\0{key}".encode()))


def block_hash(parent: int, token_ids: list[int]) -> int:
    digest = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    digest.update(array("I", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "big")


def extend_hashes(hashes: list[int], token_ids: list[int], block_size: int, seed: int,
                  num_blocks: int | None = None) -> list[int]:
    """Append to ``hashes`` (the chain of ``token_ids``' first blocks) the hashes of the
    next full blocks, up to ``num_blocks`` in all (default: every full block)."""
    full = len(token_ids) // block_size
    last = full if num_blocks is None else min(full, num_blocks)
    parent = hashes[-1] if hashes else seed
    for index in range(len(hashes), last):
        parent = block_hash(parent, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: list[int], block_size: int, seed: int) -> list[int]:
    """The hash of each full block of ``token_ids``."""
    return extend_hashes([], token_ids, block_size, seed)
