"""The native CPU paged attention kernels, called via ctypes: decode (csrc/paged_decode.c)
and causal prefill (csrc/paged_prefill.c, AVX2 + FMA or AVX-512 hosts).

Built on first use by `engine.cpu.build`; where that fails (or the CPU lacks what a kernel
needs), the loader returns None and the pure-torch path is used instead.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cpu.build import load_native

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_PREFILL_SOURCE = Path(__file__).with_name("csrc") / "paged_prefill.c"
# Query rows per prefill task (positions times the kv head's query heads): each packed key
# is reused this many times; fewer rows repack keys more often.
_PREFILL_ROWS = 192
# No reassociation of the kernel's vector adds (-ffast-math allows it): the AVX2 and the
# AVX-512 kernels then add each softmax row sum in the same order, and give the same numbers.
_PREFILL_FLAGS = ("-fno-associative-math",)


def load_native_decode() -> ctypes.CDLL | None:
    """The compiled kernel library, or None if it cannot be built here."""
    lib = load_native(_SOURCE)
    if lib is not None:
        fn = lib.paged_decode_attention
        fn.restype = None
        ptr = ctypes.c_void_p
        fn.argtypes = [ptr, ctypes.c_int64] + [ptr] * 5 + [ctypes.c_int] * 6
        fn.argtypes += [ctypes.c_float] + [ctypes.c_int] * 2
    return lib


def native_decode_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [B, H, D], rows may be strided (a view of a fused q/k tensor)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D] contiguous, written in place
) -> torch.Tensor:
    b, h, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    block_table = block_table.contiguous()
    if out is None:
        out = q.new_empty(b, h, d)
    _, block_size, hkv, _ = k_cache.shape
    threads = torch.get_num_threads()
    # Whole rows per task when there are enough sequences to keep every thread busy.
    heads_per_task = hkv if b >= 4 * threads else 1
    lib.paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
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


@functools.cache
def load_native_prefill(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The prefill kernel library, or None where it cannot be built or this CPU lacks AVX2 +
    FMA (the torch path then runs SDPA). `extra_flags`: tests build the AVX2 kernel on an
    AVX-512 host with ("-mno-avx512f",)."""
    lib = load_native(_PREFILL_SOURCE, (*_PREFILL_FLAGS, *extra_flags))
    if lib is None or not lib.paged_prefill_available():
        return None
    i64, ptr, int_ = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn = lib.paged_prefill_attention
    fn.restype = int_
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, int_, ptr, ptr, ptr, int_, ptr]
    fn.argtypes += [int_] * 4 + [ctypes.c_float] + [int_] * 2
    return lib


@dataclass
class PrefillChunks:
    """A step's prefill chunks as the native kernel reads them (int64 tensors, one entry per
    chunk, in batch order)."""

    q_start: torch.Tensor  # first row of the chunk in the packed batch
    num_tokens: torch.Tensor
    num_cached: torch.Tensor  # tokens of the request in the cache before this chunk
    block_table: torch.Tensor  # [chunks, max_blocks], contiguous


def native_prefill_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        native_decode_supported(q, k_cache)
        and q.shape[-1] % 16 == 0
        and q.stride(-1) == 1
        and q.stride(-2) == q.shape[-1]
    )


def paged_prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [T, H, D], rows may be strided (a view of a fused q/k tensor)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: PrefillChunks,
    out: torch.Tensor,  # [T, H, D] contiguous: the chunks' rows are written
    scale: float,
) -> bool:
    """Causal attention of every prefill chunk over its request's cached keys (the chunk's
    own K/V already written). False (out untouched or partial) if the kernel could not get
    its scratch memory: the caller then computes these rows another way."""
    _, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    rows_per_task = max(1, -(-_PREFILL_ROWS // (h // hkv)))
    status = lib.paged_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        chunks.block_table.data_ptr(),
        chunks.block_table.shape[1],
        chunks.q_start.data_ptr(),
        chunks.num_tokens.data_ptr(),
        chunks.num_cached.data_ptr(),
        len(chunks.q_start),
        out.data_ptr(),
        h,
        hkv,
        d,
        block_size,
        scale,
        rows_per_task,
        torch.get_num_threads(),
    )
    return status == 0
