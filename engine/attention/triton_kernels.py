"""Triton kernels over the paged KV cache: FlashAttention-style attention for a whole mixed
step (varlen causal prefill chunks, chunks resuming on cached prefixes, decodes) in one
launch per layer, and the write of the step's new K/V into the cache by slot mapping.

On a CUDA device they compile for the GPU; with `TRITON_INTERPRET=1` (set before this module
is imported) Triton's interpreter runs them on CPU tensors, which is how the tests check
them against the torch reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Wider than any context: the window then masks nothing (and stays clear of int32 overflow).
_NO_WINDOW = 1 << 30
_LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, HKV, D]; an FP8 cache as its bytes
    v_cache_ptr,
    k_scale_ptr,  # FP8: the caches' scales (0-d float32)
    v_scale_ptr,
    sinks_ptr,  # SINKS: [H] each head's sink logit
    out_ptr,  # [T, H, D]
    block_table_ptr,  # [B, max_blocks]
    query_start_ptr,  # [B + 1]
    seq_len_ptr,  # [B]: cache length after this step
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    window,  # a query sees keys at positions > its own - window
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    BLOCK_N: tl.constexpr,  # keys per inner step (may span several cache blocks)
    TOKENS: tl.constexpr,  # query tokens per program
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps float32 exact (no TF32) on GPUs
    DOT_FLOAT32: tl.constexpr,  # upcast the dots' operands (see `_dot_in_float32`)
    FP8: tl.constexpr,  # the caches hold float8 e4m3 bytes, x its scale
    SINKS: tl.constexpr,  # a sink logit per head joins the softmax (gpt-oss)
):
    # One program: TOKENS query tokens x the GROUP query heads that share one kv head, as
    # the rows of one tile, so every K/V tile is read once for the whole group.
    BLOCK_M: tl.constexpr = TOKENS * GROUP_P
    request = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + request)
    q_len = tl.load(query_start_ptr + request + 1) - q_start
    if tile * TOKENS >= q_len:
        return
    seq_len = tl.load(seq_len_ptr + request)
    context = seq_len - q_len  # tokens cached before this step

    r = tl.arange(0, BLOCK_M)
    token = tile * TOKENS + r // GROUP_P
    head = kv_head * GROUP + r % GROUP_P
    row_ok = (token < q_len) & (r % GROUP_P < GROUP)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q_rows = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_rows, mask=q_mask, other=0.0)
    if DOT_FLOAT32:
        q = q.to(tl.float32)
    q_pos = context + token  # each row's position in its sequence

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        # The sink as the first key seen: its score is the running max, its weight 1, and
        # it adds nothing to the output (base 2, as the scores).
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_i = sink * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    # Keys from the tile's first query's window to its last query: blocks before and after
    # are never read (causal; sliding window).
    first_pos = tl.maximum(context + tile * TOKENS - window + 1, 0)
    first_pos = (first_pos // BLOCK_SIZE) * BLOCK_SIZE
    last_pos = tl.minimum(context + tile * TOKENS + TOKENS, seq_len)
    for start in range(first_pos, last_pos, BLOCK_N):
        k_pos = start + offs
        k_ok = k_pos < last_pos
        physical = tl.load(
            block_table_ptr + request * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0
        )
        kv_offsets = (
            physical[:, None] * stride_kb
            + (k_pos % BLOCK_SIZE)[:, None] * stride_ks
            + kv_head * stride_kh
            + dims[None, :]
        )
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        if FP8:
            k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0)
            v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0)
            k = (k.to(tl.float8e4nv, bitcast=True).to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * v_scale).to(q.dtype)
        else:
            k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if DOT_FLOAT32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep -inf; subtracting 0 there avoids inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # p in the cache's dtype: half-precision tensor-core dots, float32 accumulation.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_rows, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _write_kv(
    k_ptr,  # [T, HKV, D]
    v_ptr,
    k_cache_ptr,  # [num_slots, HKV, D] (the cache seen as slots)
    v_cache_ptr,
    slot_ptr,  # [T]
    stride_kt,
    stride_vt,
    stride_cs,
    ROW: tl.constexpr,  # HKV * D
    BLOCK: tl.constexpr,  # ROW rounded up to a power of two
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    k = tl.load(k_ptr + token * stride_kt + offs, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + offs, mask=ok)
    tl.store(k_cache_ptr + slot * stride_cs + offs, k, mask=ok)
    tl.store(v_cache_ptr + slot * stride_cs + offs, v, mask=ok)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the step's new K and V ([T, HKV, D]) into their cache slots."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    k, v = k.reshape(tokens, row), v.reshape(tokens, row)
    if k.stride(1) != 1:
        k = k.contiguous()
    if v.stride(1) != 1:
        v = v.contiguous()
    _write_kv[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        row,
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of every request's new queries over its cached keys (the new K/V
    already written), into `out`; with a sliding window, over the last `sliding_window`
    positions only. q and out: [T, H, D] with unit stride over D. An FP8 cache
    (torch.float8_e4m3fn) is read times `kv_scales`; `sinks` ([H]) join each head's
    softmax as keys without values."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_scale, v_scale = kv_scales if fp8 else (q, q)  # unread without FP8
    num_requests = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    group_p = triton.next_power_of_2(group)
    # Rows per program: 16 (the smallest tensor-core tile) for decodes, 64 for prefill.
    rows = 16 if max_query_len == 1 else 64
    tokens = max(1, rows // group_p)
    grid = (num_requests, triton.cdiv(max_query_len, tokens), num_kv_heads)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _paged_attention[grid](
        q,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        k_scale,
        v_scale,
        q if sinks is None else sinks,  # unread without sinks
        out,
        block_table,
        query_start_loc,
        seq_lens,
        scale * _LOG2_E,
        sliding_window or _NO_WINDOW,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=64 if head_dim <= 128 else 32,
        TOKENS=tokens,
        GROUP=group,
        GROUP_P=group_p,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FLOAT32=_dot_in_float32(q.dtype),
        FP8=fp8,
        SINKS=sinks is not None,
        # Prefill tiles of large heads hold a 64 x head_dim float32 accumulator: more warps
        # share it instead of spilling registers.
        num_warps=8 if rows * block_d >= 64 * 128 else 4,
    )


def _dot_in_float32(dtype: torch.dtype) -> bool:
    """float32 models; and bfloat16 under Triton's interpreter, whose bfloat16 dot returns
    garbage (loads, stores and the softmax still run in bfloat16 there)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return dtype == torch.float32 or (interpreted and dtype == torch.bfloat16)
