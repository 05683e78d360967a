"""The `flashinfer` attention backend: FlashInfer's paged prefill/append kernel over our
cache (`pip install dynabatch[gpu]`; CUDA, float16 or bfloat16, head_dim 64/128/256).

One wrapper serves the whole mixed step (a decode is a one-token append): it is planned
once per step, on the first layer's call, and run by every layer. The cache layout is ours,
[num_blocks, block_size, num_kv_heads, head_dim], which FlashInfer calls NHD; our block
table becomes its CSR page lists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, BatchLayout, write_kv

# FlashInfer's scratch for split-KV partial results and its scheduler's plan.
WORKSPACE_BYTES = 256 << 20


@dataclass
class FlashInferMetadata:
    slot_mapping: torch.Tensor  # [T]
    qo_indptr: torch.Tensor  # [B + 1] int32, host: each request's rows in q
    kv_indptr: torch.Tensor  # [B + 1] int32, host: each request's pages in kv_indices
    kv_indices: torch.Tensor  # [sum of pages] int32, device: physical block ids
    last_page_len: torch.Tensor  # [B] int32, host: tokens in each request's last block
    window_left: int  # keys a query sees to its left (-1: all)
    planned: bool = False


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self._wrapper = None  # made on the first step, on the cache's device

    def prepare(self, layout: BatchLayout) -> FlashInferMetadata:
        bs = layout.block_size
        pages = [-(-n // bs) for n in layout.seq_lens]
        kv_indptr = list(itertools.accumulate(pages, initial=0))
        device = layout.block_table.device
        rows = torch.repeat_interleave(torch.arange(len(pages)), torch.tensor(pages))
        cols = torch.arange(kv_indptr[-1]) - torch.tensor(kv_indptr[:-1])[rows]
        kv_indices = layout.block_table[rows.to(device), cols.to(device)].to(torch.int32)
        window = layout.sliding_window
        return FlashInferMetadata(
            slot_mapping=layout.slot_mapping,
            qo_indptr=torch.tensor(layout.query_start_loc, dtype=torch.int32),
            kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32),
            kv_indices=kv_indices,
            last_page_len=torch.tensor(
                [n - (p - 1) * bs for n, p in zip(layout.seq_lens, pages, strict=True)],
                dtype=torch.int32,
            ),
            # FlashInfer's window counts the keys left of the query; ours includes the query.
            window_left=-1 if window is None else window - 1,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: FlashInferMetadata,
        scale: float,
        kv_scales: object = None,  # FP8 caches are not run here (supports_fp8_kv)
        sinks: object = None,  # nor sinks and per-layer windows (supports_sinks)
        windowed: bool = True,
    ) -> torch.Tensor:
        m = metadata
        write_kv(k, v, k_cache, v_cache, m.slot_mapping)
        wrapper = self._wrapper_on(q.device)
        if not m.planned:
            _, block_size, num_kv_heads, head_dim = k_cache.shape
            wrapper.plan(
                m.qo_indptr,
                m.kv_indptr,
                m.kv_indices,
                m.last_page_len,
                q.shape[1],
                num_kv_heads,
                head_dim,
                block_size,
                causal=True,
                sm_scale=scale,
                window_left=m.window_left,
                q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
            )
            m.planned = True
        return wrapper.run(q.contiguous(), (k_cache, v_cache))

    def _wrapper_on(self, device: torch.device):
        if self._wrapper is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        return self._wrapper
