"""The attention backend interface: paged KV write + attention over one packed batch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class BatchLayout:
    """Where every request's tokens sit in the packed batch, backend-neutral.

    NOTE: requests with exactly one new token (decodes) come first, so decode attention
    can run as one batched call over `num_decodes` rows.
    """

    num_decodes: int  # requests 0..num_decodes-1 have one new token each
    query_start_loc: list[int]  # [B+1] offsets of each request's tokens in the batch
    num_computed: list[int]  # [B] tokens already in the cache before this step
    seq_lens: list[int]  # [B] cache length after this step
    block_table: torch.Tensor  # [B, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token
    block_size: int
    # Each query sees only the keys of the last `sliding_window` positions, its own included
    # (Mistral's convention); None: the whole context.
    sliding_window: int | None = None


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends over it.

    Contract: `prepare` is called once per step and returns metadata that `forward` reads for
    every layer; `forward` writes k and v at `layout.slot_mapping` into the layer's caches
    (shaped [num_blocks, block_size, num_kv_heads, head_dim]) and returns causal attention of
    each query over its request's cached keys, shaped like q ([T, num_heads, head_dim]).
    """

    name: str

    @abstractmethod
    def prepare(self, layout: BatchLayout) -> object: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor: ...

    # Backends whose decode path a CUDA graph can capture (engine/runner/decode_graphs.py).
    supports_graphs = False

    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        sliding_window: int | None,
    ) -> object:
        """Metadata of a decode-only step (one new token per row) made from device tensors
        alone, with tensor operations only: what `prepare` gives, but graph-safe. Only where
        `supports_graphs`."""
        raise NotImplementedError(f"the {self.name} backend runs no graphs")


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K and V into their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
