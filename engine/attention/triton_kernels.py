"""Triton kernels over the paged KV cache: FlashAttention-style attention for a whole mixed
step (varlen causal prefill chunks, chunks resuming on cached prefixes, decodes) in one
launch per layer, and the write of the step's new K/V into the cache by slot mapping.

On a CUDA device they compile for the GPU; with `TRITON_INTERPRET=1` (set before this module
is imported) Triton's interpreter runs them on CPU tensors, which is how the tests check
them against the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, HKV, D]
    v_cache_ptr,
    out_ptr,  # [T, H, D]
    block_table_ptr,  # [B, max_blocks]
    query_start_ptr,  # [B + 1]
    seq_len_ptr,  # [B]: cache length after this step
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    BLOCK_N: tl.constexpr,  # BLOCK_SIZE rounded up to a power of two
    BLOCK_M: tl.constexpr,  # query rows per program
    GROUP: tl.constexpr,  # query heads per kv head
):
    request = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + request)
    q_len = tl.load(query_start_ptr + request + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_len_ptr + request)
    context = seq_len - q_len  # tokens cached before this step

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    q_pos = context + rows  # each query's position in its sequence

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    # Keys up to the tile's last query position: causal, so later blocks are never read.
    last_pos = tl.minimum(context + tile * BLOCK_M + BLOCK_M, seq_len)
    num_blocks = tl.cdiv(last_pos, BLOCK_SIZE)
    for j in range(0, num_blocks):
        physical = tl.load(block_table_ptr + request * stride_bt + j)
        k_pos = j * BLOCK_SIZE + offs
        k_ok = (offs < BLOCK_SIZE) & (k_pos < seq_len)
        kv_offsets = (
            physical * stride_kb
            + offs[:, None] * stride_ks
            + kv_head * stride_kh
            + dims[None, :]
        )
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet keep -inf; subtracting 0 there avoids inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


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
) -> None:
    """Causal attention of every request's new queries over its cached keys (the new K/V
    already written), into `out`. q and out: [T, H, D] with unit stride over D."""
    num_requests = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    block_m = 16 if max_query_len <= 16 else 64
    grid = (num_requests, triton.cdiv(max_query_len, block_m), num_heads)
    _paged_attention[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_table,
        query_start_loc,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_N=max(16, triton.next_power_of_2(block_size)),
        BLOCK_M=block_m,
        GROUP=num_heads // num_kv_heads,
    )
