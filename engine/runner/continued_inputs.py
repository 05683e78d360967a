"""The inputs of a step launched before the step before it is collected
(engine/core/sched/continuation.py) that only the device has: its rows' input tokens, which the
step before sampled, taken from that step's sampled tensor without a copy to the host."""

from __future__ import annotations

import torch

from engine.core.outputs import UNKNOWN_TOKEN, ScheduledRequest
from engine.model.collectives import TensorParallel
from engine.sampling.transfers import to_device


def _unknown_rows(order: list[ScheduledRequest]) -> list[int]:
    """The rows of `order` whose input token is UNKNOWN_TOKEN (decodes, first in `order`)."""
    return [i for i, r in enumerate(order) if r.token_ids[0] == UNKNOWN_TOKEN]


def known_inputs(
    order: list[ScheduledRequest], sampled_ids: list[str], sampled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of `order` whose input token is UNKNOWN_TOKEN and their tokens (int64) from
    the step before's `sampled` (one per `sampled_ids`), on the device; None if none."""
    rows = _unknown_rows(order)
    if not rows:
        return None
    row_of = {rid: row for row, rid in enumerate(sampled_ids)}
    sources = [row_of[order[i].request_id] for i in rows]
    device = sampled.device
    return to_device(rows, device), sampled[to_device(sources, device)].long()


def awaited_inputs(
    order: list[ScheduledRequest], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`known_inputs` on a rank that does not sample: the rows, and room for their tokens
    (filled by rank 0's broadcast); None if none."""
    rows = _unknown_rows(order)
    if not rows:
        return None
    return to_device(rows, device), torch.empty(len(rows), dtype=torch.int64, device=device)


def previous_tokens(
    order: list[ScheduledRequest],
    sampled: list[ScheduledRequest],
    known: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor | None:
    """Per row of `sampled` (the rows of `order` that sample), the token the step before
    sampled for it where only the device has it and penalties count it, else None: the
    input tokens of `known`; UNKNOWN_TOKEN in the other rows."""
    if known is None or not any(r.seen_token_ids for r in sampled):
        return None
    row_of = {id(r): j for j, r in enumerate(sampled)}
    rows = [row_of[id(order[i])] for i in _unknown_rows(order)]
    tokens = known[1]
    previous = torch.full((len(sampled),), UNKNOWN_TOKEN, dtype=tokens.dtype, device=tokens.device)
    previous[to_device(rows, tokens.device)] = tokens
    return previous


def step_known_inputs(
    order: list[ScheduledRequest],
    last_sampled: tuple[list[str], torch.Tensor],
    tp: TensorParallel | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`known_inputs` of a rank's step, `last_sampled` its step before's (request ids, their
    tokens on the device); under tensor parallelism rank 0 (which samples) broadcasts those
    tokens to the other ranks, device to device."""
    if tp is None or tp.shard.rank == 0:
        known = known_inputs(order, *last_sampled)
    else:
        known = awaited_inputs(order, device)
    if tp is not None and known is not None:
        tp.broadcast(known[1])
    return known
