"""The reference paged attention in plain torch (SDPA): runs on any device and dtype."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.base import (
    FP8_KV,
    AttentionBackend,
    BatchLayout,
    KVScales,
    dequantize_kv,
    stored,
    write_kv,
)


@dataclass
class _Prefill:
    start: int  # first token of the request in the packed batch
    end: int
    seq_len: int  # cache length after this step
    block_ids: torch.Tensor | None  # None when nothing was cached before: attend to fresh k/v
    # windowed -> [n, seq_len] bool, the keys each query sees; built by the reference path on
    # first use (the native kernel needs none), at most once per step and kind of layer.
    masks: dict[bool, torch.Tensor] = field(default_factory=dict)


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_table: torch.Tensor  # [Bd, nb]
    decode_seq_lens: torch.Tensor  # [Bd] int64
    prefills: list[_Prefill]
    sliding_window: int | None = None
    # An FP8 cache's blocks read this step and the metadata over them (`_compact`).
    fp8_compact: tuple[torch.Tensor, TorchAttentionMetadata] | None = None
    # windowed -> [Bd, 1, 1, nb * block_size] bool, key within context; built only by the
    # reference path (the native kernel reads seq_lens), at most once per step and kind of
    # layer.
    decode_masks: dict[bool, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention adds to the step's: its sinks, and the window it keeps
    (None where it attends over the whole context)."""

    sinks: torch.Tensor | None
    window: int | None


# cuDNN's SDPA builds an execution plan per new shape, and a serving batch has a new shape
# nearly every step; these kernels need no plan.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    with sdpa_kernel(_CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA of q [B, H, Lq, D] over k, v [B, Hkv, Lk, D]: causal where `mask` is None, else
    over the keys `mask` (bool, broadcast to [B, H, Lq, Lk]) lets each query see. `sinks`
    [H] join each head's softmax as one more key, whose value is zero and whose score is the
    sink (a float mask adds it to a zero key's)."""
    if sinks is None:
        if mask is None:
            return _sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return _sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    (b, h, lq, _), lk = q.shape, k.shape[2]
    if mask is None:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    bias = torch.zeros(b, h, lq, lk + 1, dtype=q.dtype, device=q.device)
    bias[..., :lk].masked_fill_(~mask, float("-inf"))
    bias[..., lk] = sinks.to(q.dtype)[None, :, None]
    zero = k.new_zeros(b, k.shape[1], 1, k.shape[3])
    k, v = torch.cat([k, zero], 2), torch.cat([v, zero], 2)
    return _sdpa(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)


class TorchAttentionBackend(AttentionBackend):
    """Decodes: one SDPA call over a padded gather of their blocks. Prefill chunks: one SDPA
    call each, causal over the fresh chunk, or masked over cache + chunk when resuming."""

    name = "torch"
    supports_fp8_kv = True
    supports_sinks = True

    def prepare(self, layout: BatchLayout) -> TorchAttentionMetadata:
        bs = layout.block_size
        nd = layout.num_decodes
        device = layout.block_table.device
        if nd:
            seq_lens = torch.tensor(layout.seq_lens[:nd], device=device)
            nb = -(-int(max(layout.seq_lens[:nd])) // bs)
            dbt = layout.block_table[:nd, :nb]
        else:
            seq_lens = torch.zeros(0, dtype=torch.long, device=device)
            dbt = layout.block_table[:0]
        prefills = []
        for i in range(nd, len(layout.seq_lens)):
            start, end = layout.query_start_loc[i], layout.query_start_loc[i + 1]
            done, seq_len = layout.num_computed[i], layout.seq_lens[i]
            if done == 0:
                prefills.append(_Prefill(start, end, seq_len, None))
                continue
            nb = -(-seq_len // bs)
            prefills.append(_Prefill(start, end, seq_len, layout.block_table[i, :nb]))
        return TorchAttentionMetadata(
            layout.slot_mapping, nd, dbt, seq_lens, prefills, layout.sliding_window
        )

    # Graph-safe decode metadata, but no graphs in the runner: a padded gather reads every
    # row's whole block table (max_model_len), where eager steps read their contexts.
    supports_graphs = False

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        sliding_window: int | None,
        max_query_len: int = 1,
    ) -> TorchAttentionMetadata:
        assert max_query_len == 1, "the torch backend's graph-safe metadata is for decodes"
        return TorchAttentionMetadata(
            slot_mapping, len(seq_lens), block_table, seq_lens, [], sliding_window
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
        sinks: torch.Tensor | None = None,
        windowed: bool = True,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, kv_scales)
        layer = LayerAttention(sinks, metadata.sliding_window if windowed else None)
        if k_cache.dtype == FP8_KV:  # attend to what the cache holds, fresh tokens too
            assert kv_scales is not None
            return self._fp8_forward(q, k, v, k_cache, v_cache, metadata, scale, kv_scales, layer)
        out = torch.empty_like(q)
        if metadata.num_decodes:
            self.decode(q, k_cache, v_cache, metadata, scale, out, layer)
        self.prefill(q, k, v, k_cache, v_cache, metadata, scale, out, layer)
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        m: TorchAttentionMetadata,
        scale: float,
        out: torch.Tensor,
        layer: LayerAttention,
    ) -> None:
        """Attention of the decode rows (the first `m.num_decodes` of q) into `out`."""
        nd = m.num_decodes
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        window = layer.window
        mask = m.decode_masks.get(window is not None)
        if mask is None:
            keys = torch.arange(m.decode_block_table.shape[1] * k_cache.shape[1], device=q.device)
            mask = keys[None, :] < m.decode_seq_lens[:, None]
            if window is not None:
                mask &= keys[None, :] >= m.decode_seq_lens[:, None] - window
            mask = m.decode_masks[window is not None] = mask.view(nd, 1, 1, -1)
        length = mask.shape[-1]
        kd = k_cache[m.decode_block_table].view(nd, length, num_kv_heads, head_dim)
        vd = v_cache[m.decode_block_table].view(nd, length, num_kv_heads, head_dim)
        od = _attend(
            q[:nd].unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2), mask, scale, layer.sinks
        )
        out[:nd] = od.squeeze(2)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        m: TorchAttentionMetadata,
        scale: float,
        out: torch.Tensor,
        layer: LayerAttention,
    ) -> None:
        """Attention of every prefill chunk's rows into `out`."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        window = layer.window
        for p in m.prefills:
            qi = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if p.block_ids is None and (window is None or p.seq_len <= window):
                ki = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
                vi = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
                oi = _attend(qi, ki, vi, None, scale, layer.sinks)
            else:
                mask = p.masks.get(window is not None)
                if mask is None:
                    k_pos = torch.arange(p.seq_len, device=q.device)
                    q_pos = k_pos[p.seq_len - (p.end - p.start) :]
                    mask = k_pos[None, :] <= q_pos[:, None]
                    if window is not None:
                        mask &= k_pos[None, :] > q_pos[:, None] - window
                    p.masks[window is not None] = mask
                if p.block_ids is None:  # a fresh chunk longer than the window
                    ki, vi = k[p.start : p.end], v[p.start : p.end]
                else:
                    ki = k_cache[p.block_ids].view(-1, num_kv_heads, head_dim)[: p.seq_len]
                    vi = v_cache[p.block_ids].view(-1, num_kv_heads, head_dim)[: p.seq_len]
                oi = _attend(
                    qi,
                    ki.transpose(0, 1).unsqueeze(0),
                    vi.transpose(0, 1).unsqueeze(0),
                    mask,
                    scale,
                    layer.sinks,
                )
            out[p.start : p.end] = oi[0].transpose(0, 1)

    def _fp8_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        kv_scales: KVScales,
        layer: LayerAttention,
    ) -> torch.Tensor:
        """`forward` over an FP8 cache: the blocks the step reads are dequantized into a
        compact float cache (the rest is never touched), and the step's own k/v go through
        the cache's rounding, so outputs do not depend on how a prompt was chunked."""
        if metadata.fp8_compact is None:
            metadata.fp8_compact = _compact(metadata)
        used, compact = metadata.fp8_compact
        slots = metadata.slot_mapping
        k_bytes, v_bytes = stored(k_cache), stored(v_cache)

        def read(cache: torch.Tensor, index: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return dequantize_kv(cache[index].view(FP8_KV), scale, q.dtype)

        k_rows, v_rows = (c.view(-1, *c.shape[2:]) for c in (k_bytes, v_bytes))
        k, v = read(k_rows, slots, kv_scales[0]), read(v_rows, slots, kv_scales[1])
        k_used, v_used = read(k_bytes, used, kv_scales[0]), read(v_bytes, used, kv_scales[1])
        out = torch.empty_like(q)
        if compact.num_decodes:
            self.decode(q, k_used, v_used, compact, scale, out, layer)
        self.prefill(q, k, v, k_used, v_used, compact, scale, out, layer)
        return out


def _compact(m: TorchAttentionMetadata) -> tuple[torch.Tensor, TorchAttentionMetadata]:
    """The cache blocks a step reads, and the step's metadata with its block ids pointing
    into a cache of those blocks alone (in that order)."""
    tables = [m.decode_block_table.reshape(-1)]
    tables += [p.block_ids for p in m.prefills if p.block_ids is not None]
    used = torch.unique(torch.cat(tables))
    remap = torch.zeros(int(used.max()) + 1 if used.numel() else 1, dtype=torch.long)
    remap = remap.to(used.device)
    remap[used] = torch.arange(len(used), device=used.device)
    prefills = [
        replace(p, block_ids=None if p.block_ids is None else remap[p.block_ids], masks={})
        for p in m.prefills
    ]
    table = remap[m.decode_block_table]
    return used, replace(m, decode_block_table=table, decode_masks={}, prefills=prefills)
