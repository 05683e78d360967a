"""The `triton` attention backend: our FlashAttention-style paged kernel, one launch per
layer for a whole mixed step (engine/attention/triton_kernels.py). CUDA devices; CPU tensors
only under Triton's interpreter (`TRITON_INTERPRET=1`, for tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import FP8_KV, AttentionBackend, BatchLayout, KVScales
from engine.attention.base import write_kv as write_quantized_kv


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    block_table: torch.Tensor  # [B, max_blocks]
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    max_query_len: int
    sliding_window: int | None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_fp8_kv = True
    supports_sinks = True

    def __init__(self) -> None:
        # Imported here: triton is needed only by whoever picks this backend.
        from engine.attention import triton_kernels

        self._kernels = triton_kernels

    def prepare(self, layout: BatchLayout) -> TritonAttentionMetadata:
        device = layout.block_table.device
        starts = layout.query_start_loc
        max_query_len = max(b - a for a, b in zip(starts, starts[1:], strict=False))
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            block_table=layout.block_table.contiguous(),
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(layout.seq_lens, dtype=torch.int64, device=device),
            max_query_len=max_query_len,
            sliding_window=layout.sliding_window,
        )

    supports_graphs = True

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        sliding_window: int | None,
        max_query_len: int = 1,
    ) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping, block_table, query_start_loc, seq_lens, max_query_len, sliding_window
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
        sinks: torch.Tensor | None = None,
        windowed: bool = True,
    ) -> torch.Tensor:
        m = metadata
        if k_cache.dtype == FP8_KV:
            # Quantized by torch ops: Triton's interpreter rounds float32 -> e4m3 wrongly at
            # binade boundaries, and the write is a small part of a layer's work.
            write_quantized_kv(k, v, k_cache, v_cache, m.slot_mapping, kv_scales)
        else:
            self._kernels.write_kv(k, v, k_cache, v_cache, m.slot_mapping)
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            out,
            m.block_table,
            m.query_start_loc,
            m.seq_lens,
            m.max_query_len,
            scale,
            m.sliding_window if windowed else None,
            kv_scales,
            sinks,
        )
        return out
