"""Weight-only quantized GEMM on CUDA: y = x @ dequantize(W).T with W dequantized in registers
and float32 accumulation (Triton). Two weight layouts (engine/quant/linear.py):

- INT4: int32 [N, K/8] words, eight input columns each (nibble j = column 8w + j); a float32
  scale and a uint8 zero point per output row and group, the group of column k is g_idx[k]
  (GPTQ's act-order groups come out of the same gather).
- FP8 blocks: float8 e4m3 [N, K] read as bytes; a float32 scale per (bn x bk) block (a scale
  per output row is the block 1 x K: FP8 weights on GPUs without FP8 tensor cores).

Nothing of the dequantized weight's size is written: decode steps read 4 or 8 bits a weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 64
_BLOCK_K = 64


@triton.jit
def _dequant_gemm(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    group_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    num_groups,
    scale_cols,
    INT4: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        w_mask = (rn[:, None] < N) & (rk[None, :] < K)
        if INT4:
            words = tl.load(w_ptr + rn[:, None] * (K // 8) + rk[None, :] // 8, mask=w_mask, other=0)
            q = (words >> ((rk[None, :] % 8) * 4)) & 0xF
            group = tl.load(group_ptr + rk, mask=rk < K, other=0)
            at = rn[:, None] * num_groups + group[None, :]
            scale = tl.load(scale_ptr + at, mask=w_mask, other=0.0)
            zero = tl.load(zero_ptr + at, mask=w_mask, other=0).to(tl.int32)
            w = (q - zero).to(tl.float32) * scale
        else:
            raw = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=w_mask, other=0)
            at = (rn[:, None] // SCALE_ROWS) * scale_cols + rk[None, :] // SCALE_COLS
            scale = tl.load(scale_ptr + at, mask=w_mask, other=0.0)
            w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        if IEEE:  # float32 activations: no TF32 rounding of the products
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    y_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), y_mask)


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def _launch(
    x: torch.Tensor,
    n: int,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: torch.Tensor,
    num_groups: int,
    scale_cols: int,
    **layout: object,
) -> torch.Tensor:
    m, k = x.shape
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = _block_m(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, _BLOCK_N))
    _dequant_gemm[grid](
        x, weight, scale, zero, group, y, m, n, k, x.stride(0), y.stride(0), num_groups,
        scale_cols, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K, **layout,
    )  # fmt: skip
    return y


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
) -> torch.Tensor:
    """x [M, K] @ dequantize(INT4 W [N, K]).T -> [M, N] in x's dtype."""
    n, groups = scales.shape
    layout = {"INT4": True, "SCALE_ROWS": 1, "SCALE_COLS": 1}
    return _launch(x, n, qweight, scales, zeros, g_idx, groups, 0, **layout)


# Wider than any row: with it a block spans every input column.
_WHOLE_ROW = 1 << 30


def fp8_rows_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (FP8 W [N, K] * its per-row scales [N]).T -> [M, N] (weight-only FP8)."""
    layout = {"INT4": False, "SCALE_ROWS": 1, "SCALE_COLS": _WHOLE_ROW}
    raw = weight.view(torch.uint8)
    return _launch(x, weight.shape[0], raw, scale, scale, scale, 0, 1, **layout)


def fp8_block_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """x [M, K] @ (FP8 W [N, K] * its block scales).T -> [M, N] in x's dtype."""
    layout = {"INT4": False, "SCALE_ROWS": block[0], "SCALE_COLS": block[1]}
    raw = weight.view(torch.uint8)
    return _launch(x, weight.shape[0], raw, scale, scale, scale, 0, scale.shape[1], **layout)
