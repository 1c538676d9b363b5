"""Large CPU buffers on transparent huge pages: the KV cache and the packed weights.

On 4 KiB pages the paged attention kernel takes a TLB miss and a page walk on nearly every
2 KiB KV block it reads (blocks sit anywhere in the cache), and a matmul streaming a
weight walks a page table every 4 KiB. Backed by 2 MiB pages (``madvise(MADV_HUGEPAGE)``,
honoured where the kernel's transparent huge pages are in ``madvise`` or ``always`` mode),
batch-64 decode attention ran ~7 % faster here, and SmolLM2's projections at batch 1
~17 % faster. Where the call is refused the buffers stay on small pages.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed CPU tensors of ``shapes`` from one huge-page buffer (see ``empty``)."""
    tensors = empty(shapes, dtype)
    for tensor in tensors:
        tensor.zero_()
    return tensors


def empty(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """CPU tensors of ``shapes``, carved from one buffer whose 2 MiB-aligned span is advised
    onto huge pages before it is first touched; memory is taken only as they are written.
    Each tensor starts 64-byte aligned."""
    if not shapes:
        return []
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = [-(-math.prod(shape) * itemsize // 64) * 64 for shape in shapes]
    total = sum(sizes)
    raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    buffer = raw[start : start + total]
    _advise_huge_pages(buffer.data_ptr(), total)
    tensors, offset = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        tensors.append(buffer[offset : offset + math.prod(shape) * itemsize].view(dtype).view(shape))
        offset += size
    return tensors


def _advise_huge_pages(address: int, length: int) -> None:
    if not sys.platform.startswith("linux") or length < HUGE_PAGE:
        return
    length = length // HUGE_PAGE * HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d); the buffer stays on 4 KiB pages",
                  ctypes.get_errno())
