"""The attention backend interface: paged KV write + attention over one packed batch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

# An FP8 cache's per-tensor scales of one layer: (k_scale, v_scale), 0-d float32 tensors on
# the cache's device (read by kernels, so CUDA graphs see updates made in place).
KVScales = tuple[torch.Tensor, torch.Tensor]
FP8_KV = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8_KV).max


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
    An FP8 cache (dtype FP8_KV, only for backends with `supports_fp8_kv`) holds k / k_scale
    and v / v_scale (`kv_scales`), and attention reads every key and value, the step's own
    included, as the cache holds them. `sinks` ([num_heads] logits, only for backends with
    `supports_sinks`) join each head's softmax as a key without a value; a layer that is not
    `windowed` attends over the whole context even where the step has a sliding window
    (layers of both kinds: only for backends with `supports_sinks`).
    """

    supports_fp8_kv = False
    supports_sinks = False

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
        kv_scales: KVScales | None = None,
        sinks: torch.Tensor | None = None,
        windowed: bool = True,
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
        max_query_len: int = 1,
    ) -> object:
        """Metadata of a decode-only step (`max_query_len` new tokens in every row: 1, or a
        last token and its drafts) made from device tensors alone, with tensor operations
        only: what `prepare` gives, but graph-safe. Only where `supports_graphs`."""
        raise NotImplementedError(f"the {self.name} backend runs no graphs")


def stored(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as its bytes (CPU torch has no FP8 indexing or index_copy), else itself."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV else cache


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K or V -> what an FP8 cache holds of it (saturating: e4m3 has no infinity)."""
    return (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_KV)


def calculate_kv_scales(kv_scales: KVScales, k: torch.Tensor, v: torch.Tensor) -> None:
    """Set an FP8 cache's scales (in place) so these keys and values just fit."""
    for scale, x in zip(kv_scales, (k, v), strict=True):
        scale.copy_((x.abs().amax().float() / _FP8_MAX).clamp(min=1e-6))


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    """Scatter the new tokens' K and V into their cache slots (quantized into an FP8
    cache)."""
    if k_cache.dtype == FP8_KV:
        assert kv_scales is not None, "an FP8 KV cache needs its scales"
        k = stored(quantize_kv(k, kv_scales[0]))
        v = stored(quantize_kv(v, kv_scales[1]))
        k_cache, v_cache = stored(k_cache), stored(v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
