"""The native CPU paged decode kernel (csrc/paged_decode.c), called via ctypes.

Built on first use by `engine.native_build`; where that fails, `load_native_decode()` returns
None and the pure-torch path is used instead.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.native_build import load_native

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"


def load_native_decode() -> ctypes.CDLL | None:
    """The compiled kernel library, or None if it cannot be built here."""
    lib = load_native(_SOURCE)
    if lib is not None:
        fn = lib.paged_decode_attention
        fn.restype = None
        fn.argtypes = (
            [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 2
        )
    return lib


def native_decode_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:
    q = q.contiguous()
    block_table = block_table.contiguous()
    out = torch.empty_like(q)
    b, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    threads = torch.get_num_threads()
    # Whole rows per task when there are enough sequences to keep every thread busy.
    heads_per_task = hkv if b >= 4 * threads else 1
    lib.paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        hkv,
        d,
        block_size,
        block_table.shape[1],
        scale,
        heads_per_task,
        threads,
    )
    return out
