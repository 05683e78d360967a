"""LoRA's segmented shrink and expand on CUDA (Triton): each program takes a tile of one
segment's tokens (one adapter slot) and a tile of output columns, so a whole step's adapters
are one launch per factor, whatever their number.

    shrink: s[t, :] = x[t, :] @ A^T[slot(t)]            ([in, P R] per slot)
    expand: out[t, row:row + n] += s[t, pR:(p+1)R] @ B^T_p[slot(t)]   ([R, n] per slot)

With `TRITON_INTERPRET=1` (set before this module is imported) Triton's interpreter runs them
on CPU tensors: that is how the tests check them against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_M = 16  # tokens per program
_BLOCK_N = 32  # output columns per program
_BLOCK_K = 32  # shrink: input columns per inner step


@triton.jit
def _lora_shrink(
    x_ptr,  # [T, K]
    a_ptr,  # [slots, K, N]
    s_ptr,  # [T, N] float32
    seg_slot_ptr,
    seg_start_ptr,
    seg_end_ptr,
    K,
    N,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ak,
    stride_st,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    end = tl.load(seg_end_ptr + seg)
    rows = tl.load(seg_start_ptr + seg) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < end, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * stride_as + ks[:, None] * stride_ak + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision=DOT_PRECISION)
    tl.store(
        s_ptr + rows[:, None] * stride_st + cols[None, :],
        acc,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _lora_expand(
    s_ptr,  # [T, P R] float32
    b_ptr,  # [slots, R, N]
    out_ptr,  # [T, out]
    seg_slot_ptr,
    seg_start_ptr,
    seg_end_ptr,
    R,
    N,
    s_col,  # this part's first column of s
    out_col,  # this part's first column of out
    stride_st,
    stride_bs,
    stride_br,
    stride_ot,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    end = tl.load(seg_end_ptr + seg)
    rows = tl.load(seg_start_ptr + seg) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    row_ok, col_ok, rank_ok = rows < end, cols < N, ranks < R
    s = tl.load(
        s_ptr + rows[:, None] * stride_st + (s_col + ranks)[None, :],
        mask=row_ok[:, None] & rank_ok[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :],
        mask=rank_ok[:, None] & col_ok[None, :],
        other=0.0,
    )
    delta = tl.dot(s, b.to(tl.float32), input_precision=DOT_PRECISION)
    where = out_ptr + rows[:, None] * stride_ot + (out_col + cols)[None, :] * stride_on
    ok = row_ok[:, None] & col_ok[None, :]
    old = tl.load(where, mask=ok, other=0.0)
    tl.store(where, (old.to(tl.float32) + delta).to(old.dtype), mask=ok)


class KernelSegments:
    """A step's segments as the kernels read them (on the device)."""

    def __init__(self, segments: list[tuple[int, int, int]], device: torch.device) -> None:
        columns = torch.tensor(segments, dtype=torch.int32).t().contiguous()
        self.slots, self.starts, self.ends = columns.to(device, non_blocking=True)
        self.count = len(segments)
        self.longest = max(j - i for _, i, j in segments)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg: KernelSegments) -> torch.Tensor:
    """x [T, in] (token-major), a: A^T of every slot [slots, in, P R] -> s [T, P R] float32
    (rows outside the segments are left unset)."""
    k, n = a.shape[1], a.shape[2]
    s = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    grid = (seg.count, triton.cdiv(seg.longest, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _lora_shrink[grid](
        x, a, s, seg.slots, seg.starts, seg.ends, k, n,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), s.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        DOT_PRECISION=_precision(x.dtype),
    )  # fmt: skip
    return s


def lora_expand(
    s: torch.Tensor, b: torch.Tensor, out: torch.Tensor, s_col: int, out_col: int, seg
) -> None:
    """out[t, out_col:out_col + n] += s[t, s_col:s_col + R] @ b[slot(t)] (b: [slots, R, n])
    for every segment token t, in place (out token-major, any strides)."""
    r, n = b.shape[1], b.shape[2]
    grid = (seg.count, triton.cdiv(seg.longest, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _lora_expand[grid](
        s, b, out, seg.slots, seg.starts, seg.ends, r, n, s_col, out_col,
        s.stride(0), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(r)),
        DOT_PRECISION=_precision(out.dtype),
    )  # fmt: skip
