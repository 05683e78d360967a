"""Host memory tuning: keep freed memory in the process heap (glibc), so big per-step tensors
reuse warm pages; and huge pages for the KV cache.

By default glibc serves every allocation above a (dynamic, at most 32 MB) threshold with a
fresh mmap and returns it to the kernel on free, so each step's large activations page-fault
in again.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory_in_heap(threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds; returns False where that is not possible."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes) == 1 and ok
    except (OSError, AttributeError):
        return False
    _done = ok
    if not ok:
        logger.info("mallopt refused; large tensors will keep page-faulting")
    return ok


_HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own private anonymous mapping, advised onto 2 MiB pages
    (Linux transparent huge pages in `madvise` mode; elsewhere, or when small, plain
    `torch.zeros`). The paged KV cache is read in scattered 16 KB blocks every decode step;
    with 4 KiB pages each block costs TLB misses. Its own mapping, because heap memory that
    earlier tensors touched is already backed by small pages, which the advice does not
    change."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < 2 * _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # advice only: plain pages then
        buf.madvise(advice)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    # The tensor keeps `buf` alive; it starts on a huge-page boundary.
    t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=-address % _HUGE_PAGE)
    return t.view(shape).zero_()  # fault the pages in now, not during the first steps
