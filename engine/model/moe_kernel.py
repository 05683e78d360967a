"""The experts of a mixture-of-experts layer on CUDA (Triton): the step's (token, choice)
pairs sorted by expert, each expert's run padded to a whole number of row blocks, then two
grouped GEMMs over the stacked expert weights, one launch each whatever the experts:

    act[p, :]  = silu(x[t(p)] @ W_gate[e(p)]^T) * (x[t(p)] @ W_up[e(p)]^T)   (gate/up fused)
    y[p, :]    = weight[p] * act[p] @ W_down[e(p)]^T
    out[t, :]  = Σ_j y[(t, j)]

The block layout is built on the device (no host sync: the launch sizes depend on the
number of tokens only), so a step of it can be captured in a graph. With
`TRITON_INTERPRET=1` (set before this module is imported) Triton's interpreter runs the
kernels on CPU tensors: that is how the tests check them against the grouped torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_M = 16  # (token, choice) rows per program: an expert's run is padded to a multiple
_BLOCK_N = 32  # output columns per program
_BLOCK_K = 32  # input columns per inner step


@triton.jit
def _gate_up_act(
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]
    act_ptr,  # [T k, I] float32
    pairs_ptr,  # [blocks * BLOCK_M] pair ids, padding = num_pairs
    block_expert_ptr,  # [blocks] held expert of each block, padding = -1
    num_pairs,
    top_k,
    H,
    INTER,
    stride_xt,
    stride_we,
    stride_wn,
    stride_at,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w13_ptr + expert * stride_we
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x = tl.load(
            x_ptr + tokens[:, None] * stride_xt + ks[None, :],
            mask=pair_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=mask, other=0.0)
        wu = tl.load(w + (cols + INTER)[None, :] * stride_wn + ks[:, None], mask=mask, other=0.0)
        gate += tl.dot(x, wg.to(tl.float32), input_precision=DOT_PRECISION)
        up += tl.dot(x, wu.to(tl.float32), input_precision=DOT_PRECISION)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        act_ptr + pairs[:, None].to(tl.int64) * stride_at + cols[None, :],
        act,
        mask=pair_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _down_weighted(
    act_ptr,  # [T k, I] float32
    w2_ptr,  # [E, H, I]
    weight_ptr,  # [T k] float32
    y_ptr,  # [T k, H] float32
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    H,
    INTER,
    stride_at,
    stride_we,
    stride_wn,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w2_ptr + expert * stride_we
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < INTER
        a = tl.load(
            act_ptr + rows[:, None] * stride_at + ks[None, :],
            mask=pair_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        wd = tl.load(
            w + cols[None, :] * stride_wn + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(a, wd.to(tl.float32), input_precision=DOT_PRECISION)
    weight = tl.load(weight_ptr + rows, mask=pair_ok, other=0.0)
    tl.store(
        y_ptr + rows[:, None] * stride_yt + cols[None, :],
        acc * weight[:, None],
        mask=pair_ok[:, None] & col_ok[None, :],
    )


def block_layout(
    experts: torch.Tensor, first_expert: int, held: int, block_m: int = _BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of `experts` [T, k] (pair p = t k + j) that choose one of the `held` experts
    from `first_expert` on, sorted by expert, each expert's run padded to a multiple of
    `block_m` with the id T k; and each block's held expert (-1: a padding block). Sizes
    depend on T only: ceil(T k / block_m) + held blocks at most."""
    num_pairs = experts.numel()
    device = experts.device
    local = experts.reshape(-1).to(torch.int64) - first_expert
    mine = (local >= 0) & (local < held)
    local = torch.where(mine, local, held)  # other ranks' experts: one bucket, dropped
    counts = torch.zeros(held + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    padded = (counts[:held] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(local, stable=True)
    sorted_experts = local[order]
    rank = torch.arange(num_pairs, device=device) - run_start[sorted_experts]
    num_blocks = -(-num_pairs // block_m) + held
    size = num_blocks * block_m
    # One slot past the end takes the dropped pairs' writes: no mask, no data-dependent size.
    pairs = torch.full((size + 1,), num_pairs, dtype=torch.int32, device=device)
    where = padded_start[sorted_experts.clamp(max=held - 1)] + rank
    where = torch.where(sorted_experts < held, where, size)
    pairs.scatter_(0, where, order.to(torch.int32))
    pairs = pairs[:size]
    starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < held, block_expert, -1).to(torch.int32)
    return pairs, block_expert


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """Σ_j weights[t, j] · expert_{experts[t, j]}(x[t]) over the experts `w13` [held, 2I, H]
    and `w2` [held, H, I] hold (from `first_expert` on; others' choices add nothing), [T, H]
    in x's dtype."""
    tokens, top_k = experts.shape
    held, inter, hidden = w13.shape[0], w2.shape[2], x.shape[1]
    num_pairs = tokens * top_k
    out = torch.zeros_like(x)
    if num_pairs == 0:
        return out
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs, block_expert = block_layout(experts, first_expert, held)
    blocks = block_expert.numel()
    act = torch.empty(num_pairs, inter, dtype=torch.float32, device=x.device)
    y = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _gate_up_act[(blocks, triton.cdiv(inter, _BLOCK_N))](
        x, w13, act, pairs, block_expert, num_pairs, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, DOT_PRECISION=precision,
    )  # fmt: skip
    flat_weights = weights.reshape(-1).float().contiguous()
    _down_weighted[(blocks, triton.cdiv(hidden, _BLOCK_N))](
        act, w2, flat_weights, y, pairs, block_expert, num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, DOT_PRECISION=precision,
    )  # fmt: skip
    return out.copy_(y.view(tokens, top_k, hidden).sum(1))
