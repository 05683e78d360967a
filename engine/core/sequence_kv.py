"""A sequence's KV cache as plain data, so the sequence can leave its engine replica with it
and go on at another without computing its context again (pure Python: the tensors' bytes
are an opaque buffer here; engine/runner/kv_transfer.py reads and writes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SequenceKV:
    """The KV of a sequence's first `len(token_ids)` tokens.

    `data` holds the blocks of every layer's K and V as one buffer of bytes shaped
    [layers, 2, blocks, block_size, kv_heads, head_bytes] (head_bytes: head_dim times the
    cache dtype's size), or None from an engine that keeps no KV tensors (the emulated one):
    then only the count of computed tokens moves. FP8 caches carry their per-layer (K, V)
    scales, without which the bytes mean nothing.
    """

    token_ids: list[int]  # the tokens whose KV it holds, from the first
    block_size: int
    cache_dtype: str  # the cache's torch dtype name: "float32", "bfloat16", "float8_e4m3fn"
    # uint8: a torch tensor where the cache is, a numpy array on the host (zero-copy through
    # Ray's object store); None
    data: Any = None
    scales: tuple[tuple[float, float], ...] | None = None  # FP8: (k, v) per layer

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else int(self.data.nbytes)

    def fits(self, token_ids: list[int], block_size: int) -> bool:
        """Whether it can stand for the leading KV of a sequence of `token_ids` in a cache of
        `block_size`: the same tokens, and at least the last one left to compute (its
        logits are what the next step samples from)."""
        n = len(self.token_ids)
        return (
            block_size == self.block_size
            and 0 < n < len(token_ids)
            and token_ids[:n] == self.token_ids
        )


class SequenceMoved(Exception):
    """How a request's stream ends at the replica it left: it goes on elsewhere, with `kv`
    (None where this engine could not export it: there its context is computed again)."""

    def __init__(self, request_id: str, kv: SequenceKV | None) -> None:
        super().__init__(f"request {request_id} moved to another engine replica")
        self.request_id = request_id
        self.kv = kv
