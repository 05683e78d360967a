"""One step's packed inputs: every scheduled token of every request in one flat batch (no
padding), with per-token positions, cache slots, and the rows whose logits are sampled."""

from __future__ import annotations

import itertools
from functools import partial

import torch

from engine.attention.base import BatchLayout
from engine.core.outputs import ScheduledRequest
from engine.sampling.transfers import to_device


def packed_inputs(
    order: list[ScheduledRequest], bs: int, sliding_window: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, BatchLayout, torch.Tensor]:
    """Input ids, positions, the attention layout and the rows whose logits are needed, on
    `device` (`bs`: the cache's block size)."""
    counts = [r.num_tokens for r in order]
    starts = [r.num_computed_tokens for r in order]
    offsets = list(itertools.accumulate(counts, initial=0))
    width = max(len(r.block_ids) for r in order)
    block_table = torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in order])
    input_ids = torch.tensor(list(itertools.chain.from_iterable(r.token_ids for r in order)))
    req_idx = torch.repeat_interleave(torch.arange(len(order)), torch.tensor(counts))
    shift = torch.tensor(starts) - torch.tensor(offsets[:-1])
    positions = torch.arange(offsets[-1]) + shift[req_idx]
    slots = block_table[req_idx, positions // bs] * bs + positions % bs
    # The sampled rows (every position of a row with drafts), then the rows whose prompt
    # logprobs are asked for.
    rows = [
        j
        for i, r in enumerate(order)
        if r.sample
        for j in range(offsets[i + 1] - 1 - r.num_drafts, offsets[i + 1])
    ]
    for i, r in enumerate(order):
        if r.prompt_targets:
            rows += range(offsets[i], offsets[i] + len(r.prompt_targets))
    logits_indices = torch.tensor(rows, dtype=torch.long)
    move = partial(to_device, device=device)
    layout = BatchLayout(
        num_decodes=sum(1 for c in counts if c == 1),
        query_start_loc=offsets,
        num_computed=starts,
        seq_lens=[s + c for s, c in zip(starts, counts, strict=True)],
        block_table=move(block_table),
        slot_mapping=move(slots),
        block_size=bs,
        sliding_window=sliding_window,
    )
    return move(input_ids), move(positions), layout, move(logits_indices)
