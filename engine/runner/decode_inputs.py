"""Persistent inputs of decode-only steps, padded to a captured batch size, and the decode
forward over them that a CUDA graph captures (graph-safe: static shapes, every input read
from these buffers, no host synchronisation; checked on CPU under torch.compile).

Padding rows are requests at position 0 whose K/V go to the scratch block, a cache block the
KV manager never hands out: they write no real cache slot and no real row reads them. Inputs
of Q tokens per row carry speculative rows (a last token and its drafts), padded likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend
from engine.core.outputs import ScheduledRequest


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 16 beyond, up to and with max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += [s for s in range(16, min(max_num_seqs, 64) + 1, 8) if s < max_num_seqs]
    sizes += [s for s in range(80, max_num_seqs, 16)]
    return [*sizes, max_num_seqs]


@dataclass
class DecodeInputs:
    """Q query tokens per row (1: plain decodes; k + 1: a last token and up to k drafts, the
    rest of the row padding), N rows."""

    input_ids: torch.Tensor  # [N * Q]
    positions: torch.Tensor  # [N * Q]
    slot_mapping: torch.Tensor  # [N * Q]
    block_table: torch.Tensor  # [N, max blocks per request]
    seq_lens: torch.Tensor  # [N]
    query_start_loc: torch.Tensor  # [N + 1]: Q query tokens per row
    logits_indices: torch.Tensor  # [N * Q]: every position is sampled
    tokens_per_row: int = 1

    @classmethod
    def allocate(
        cls, rows: int, blocks_per_row: int, device: torch.device, tokens_per_row: int = 1
    ) -> DecodeInputs:
        q = tokens_per_row

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        arange = torch.arange(rows * q + 1, dtype=torch.int64, device=device)
        return cls(
            zeros(rows * q),
            zeros(rows * q),
            zeros(rows * q),
            zeros(rows, blocks_per_row),
            zeros(rows),
            arange[: rows + 1] * q,
            arange[: rows * q].clone(),
            q,
        )

    def rows(self, n: int) -> DecodeInputs:
        """Views of the first n rows (what the graph of batch size n reads)."""
        q = self.tokens_per_row
        return DecodeInputs(
            self.input_ids[: n * q],
            self.positions[: n * q],
            self.slot_mapping[: n * q],
            self.block_table[:n],
            self.seq_lens[:n],
            self.query_start_loc[: n + 1],
            self.logits_indices[: n * q],
            q,
        )

    def fill(
        self, order: list[ScheduledRequest], padded: int, block_size: int, scratch_block: int
    ) -> None:
        """Write the rows of `order` into rows 0..len-1 and padding up to `padded`: built on
        the host, copied without waiting (from pinned memory when the buffers are on a GPU).
        A row's query tokens past its own (it has fewer drafts than Q - 1) are padding too:
        they come after its real ones, which causal attention keeps from seeing them, and
        write the scratch block."""
        q, bs = self.tokens_per_row, block_size
        scratch_slot = scratch_block * bs
        pad = padded - len(order)
        # Only the columns a row's context reaches are read: the rest may hold stale ids.
        width = max([len(r.block_ids) for r in order] + [1])
        tables = [r.block_ids + [scratch_block] * (width - len(r.block_ids)) for r in order]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for r in order:
            start, n = r.num_computed_tokens, len(r.token_ids)
            ids += r.token_ids
            positions += range(start, start + q)
            slots += [r.block_ids[p // bs] * bs + p % bs for p in range(start, start + n)]
            if n < q:
                ids += [0] * (q - n)
                slots += [scratch_slot] * (q - n)
        seq_lens = [r.num_computed_tokens + q for r in order] + [q] * pad
        ids += [0] * (pad * q)
        positions += list(range(q)) * pad
        slots += [scratch_slot] * (pad * q)
        columns = torch.tensor([ids, positions, slots], dtype=torch.int64)
        lengths = torch.tensor(seq_lens, dtype=torch.int64)
        table = torch.tensor(tables + [[scratch_block] * width] * pad, dtype=torch.int64)
        if self.input_ids.is_cuda:
            columns, lengths, table = columns.pin_memory(), lengths.pin_memory(), table.pin_memory()
        for target, column in zip(
            (self.input_ids, self.positions, self.slot_mapping), columns, strict=True
        ):
            target[: padded * q].copy_(column, non_blocking=True)
        self.seq_lens[:padded].copy_(lengths, non_blocking=True)
        self.block_table[:padded, :width].copy_(table, non_blocking=True)


def decode_forward(
    model: torch.nn.Module,
    backend: AttentionBackend,
    inputs: DecodeInputs,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    sliding_window: int | None,
) -> torch.Tensor:
    """One decode step over every row of `inputs`: the final hidden states [rows x Q,
    hidden] (the LM head runs after, outside a graph: its logits would take a buffer per
    size)."""
    metadata = backend.decode_metadata(
        inputs.slot_mapping,
        inputs.block_table,
        inputs.seq_lens,
        inputs.query_start_loc,
        sliding_window,
        inputs.tokens_per_row,
    )
    return model(
        inputs.input_ids,
        inputs.positions,
        kv_caches,
        backend,
        metadata,
        inputs.logits_indices,
        hidden_only=True,
    )
