"""The inputs of a step launched before the step before it is collected
(engine/core/continuation.py) that only the device has: its rows' input tokens, which the
step before sampled, taken from that step's sampled tensor without a copy to the host."""

from __future__ import annotations

import torch

from engine.core.outputs import UNKNOWN_TOKEN, ScheduledRequest
from engine.transfers import to_device


def known_inputs(
    order: list[ScheduledRequest], sampled_ids: list[str], sampled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows of `order` whose input token is UNKNOWN_TOKEN (decodes, first in `order`) and
    their tokens from the step before's `sampled` (one per `sampled_ids`), on the device;
    None if there are none."""
    rows = [i for i, r in enumerate(order) if r.token_ids[0] == UNKNOWN_TOKEN]
    if not rows:
        return None
    row_of = {rid: row for row, rid in enumerate(sampled_ids)}
    sources = [row_of[order[i].request_id] for i in rows]
    return to_device(rows, sampled.device), sampled[to_device(sources, sampled.device)]


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
    rows = [row_of[id(r)] for r in order if r.token_ids[0] == UNKNOWN_TOKEN]
    tokens = known[1]
    previous = torch.full((len(sampled),), UNKNOWN_TOKEN, dtype=tokens.dtype, device=tokens.device)
    previous[to_device(rows, tokens.device)] = tokens
    return previous
