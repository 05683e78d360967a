"""Host memory tuning: keep freed memory in the process heap (glibc), so big per-step tensors
reuse warm pages; and huge pages for the KV cache and the weights.

By default glibc serves every allocation above a (dynamic, at most 32 MB) threshold with a
fresh mmap and returns it to the kernel on free, so each step's large activations page-fault
in again.

Every decode step streams all the weights and reads the KV cache in scattered 16 KB blocks;
on 4 KiB pages each page of either costs a TLB miss, on 2 MiB pages almost none do.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys
from pathlib import Path

import torch
from torch import nn

from engine.model.weight_slots import WeightSlot, weight_slots

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library, where it is glibc on Linux (mallopt, malloc_trim); else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory_in_heap(threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds; returns False where that is not possible."""
    global _done
    if _done:
        return True
    libc = _glibc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes) == 1 and ok
    except AttributeError:
        return False
    _done = ok
    if not ok:
        logger.info("mallopt refused; large tensors will keep page-faulting")
    return ok


_HUGE_PAGE = 2 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_on() -> bool:
    """Whether advice onto transparent huge pages can take effect here (Linux, not `never`)."""
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (uint8) in their own private anonymous mapping, advised onto 2 MiB
    pages and starting on a huge-page boundary; untouched, so each page is faulted in (and
    counted resident) only when first written. Its own mapping, because heap memory that
    earlier tensors touched is already backed by small pages, which the advice does not
    change."""
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError):  # advice only: plain pages then
        buf.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    # The tensor keeps `buf` alive.
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=-address % _HUGE_PAGE)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on huge pages (`huge_page_bytes`; where there are none, or when
    it is small, plain `torch.zeros`): the paged KV cache."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if not huge_pages_on() or nbytes < 2 * _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    t = huge_page_bytes(nbytes).view(dtype).view(shape)
    return t.zero_()  # fault the pages in now, not during the first steps


_ALIGN = 64  # a cache line: every tensor's start stays as aligned as the allocator's
_TRIM_EVERY_BYTES = 256 << 20


def weights_onto_huge_pages(model: nn.Module) -> int:
    """Move `model`'s CPU tensors (parameters, buffers, packed GEMM weights) into one mapping
    on huge pages; returns the bytes moved (0 where huge pages are off). Tensors that shared
    a storage share one after (tied embeddings, views), each at its old offset and strides.
    The old storages go back to the kernel as they are left (malloc_trim every few hundred
    MB): resident memory grows by at most that much while they move."""
    if not huge_pages_on():
        return 0
    by_storage: dict[int, list[WeightSlot]] = {}
    for slot in weight_slots(model):
        by_storage.setdefault(slot.tensor.untyped_storage().data_ptr(), []).append(slot)
    sizes = {key: group[0].tensor.untyped_storage().nbytes() for key, group in by_storage.items()}
    total = sum(_aligned(n) for n in sizes.values())
    if total == 0:
        return 0
    arena = huge_page_bytes(total)
    start = since_trim = 0
    for key, group in by_storage.items():
        nbytes = sizes[key]
        old = torch.empty(0, dtype=torch.uint8).set_(group[0].tensor.untyped_storage())
        arena[start : start + nbytes].copy_(old)
        at = arena.storage_offset() + start  # bytes from the mapping's start
        for slot in group:
            t = slot.tensor
            offset = at // t.element_size() + t.storage_offset()
            slot.put(
                torch.empty(0, dtype=t.dtype).set_(
                    arena.untyped_storage(), offset, t.size(), t.stride()
                )
            )
        del old, t  # the last references to the old storage
        start += _aligned(nbytes)
        since_trim += nbytes
        if since_trim >= _TRIM_EVERY_BYTES:
            since_trim = 0
            _trim_heap()
    _trim_heap()
    return total


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _trim_heap() -> None:
    """Freed heap memory back to the kernel (glibc's malloc_trim; elsewhere nothing)."""
    libc = _glibc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.malloc_trim(0)
