"""Persistent inputs of decode-only steps, padded to a captured batch size, and the decode
forward over them that a CUDA graph captures (graph-safe: static shapes, every input read
from these buffers, no host synchronisation; checked on CPU under torch.compile).

Padding rows are one-token requests at position 0 whose K/V go to the scratch block, a
cache block the KV manager never hands out: they write no real cache slot and no real row
reads them.
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
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N]
    block_table: torch.Tensor  # [N, max blocks per request]
    seq_lens: torch.Tensor  # [N]
    query_start_loc: torch.Tensor  # [N + 1]: one query token per row
    logits_indices: torch.Tensor  # [N]: every row is sampled

    @classmethod
    def allocate(cls, rows: int, blocks_per_row: int, device: torch.device) -> DecodeInputs:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        arange = torch.arange(rows + 1, dtype=torch.int64, device=device)
        return cls(
            zeros(rows),
            zeros(rows),
            zeros(rows),
            zeros(rows, blocks_per_row),
            zeros(rows),
            arange,
            arange[:rows].clone(),
        )

    def rows(self, n: int) -> DecodeInputs:
        """Views of the first n rows (what the graph of batch size n reads)."""
        return DecodeInputs(
            self.input_ids[:n],
            self.positions[:n],
            self.slot_mapping[:n],
            self.block_table[:n],
            self.seq_lens[:n],
            self.query_start_loc[: n + 1],
            self.logits_indices[:n],
        )

    def fill(
        self, order: list[ScheduledRequest], padded: int, block_size: int, scratch_block: int
    ) -> None:
        """Write the decodes of `order` into rows 0..len-1 and padding up to `padded`: built on
        the host, copied without waiting (from pinned memory when the buffers are on a GPU)."""
        pad = padded - len(order)
        # Only the columns a row's context reaches are read: the rest may hold stale ids.
        width = max([len(r.block_ids) for r in order] + [1])
        tables = [r.block_ids + [scratch_block] * (width - len(r.block_ids)) for r in order]
        positions = [r.num_computed_tokens for r in order]
        slots = [
            r.block_ids[p // block_size] * block_size + p % block_size
            for r, p in zip(order, positions, strict=True)
        ]
        columns = torch.tensor(
            [
                [r.token_ids[0] for r in order] + [0] * pad,
                positions + [0] * pad,
                slots + [scratch_block * block_size] * pad,
                [p + 1 for p in positions] + [1] * pad,
            ],
            dtype=torch.int64,
        )
        table = torch.tensor(tables + [[scratch_block] * width] * pad, dtype=torch.int64)
        if self.input_ids.is_cuda:
            columns, table = columns.pin_memory(), table.pin_memory()
        targets = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens)
        for target, column in zip(targets, columns, strict=True):
            target[:padded].copy_(column, non_blocking=True)
        self.block_table[:padded, :width].copy_(table, non_blocking=True)


def decode_forward(
    model: torch.nn.Module,
    backend: AttentionBackend,
    inputs: DecodeInputs,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    sliding_window: int | None,
) -> torch.Tensor:
    """One decode step over every row of `inputs`: the final hidden states [rows, hidden]
    (the LM head runs after, outside a graph: its logits would take a buffer per size)."""
    metadata = backend.decode_metadata(
        inputs.slot_mapping,
        inputs.block_table,
        inputs.seq_lens,
        inputs.query_start_loc,
        sliding_window,
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
