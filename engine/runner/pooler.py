"""Embedding requests' rows of a step: their prompts' final hidden states (after the final
norm), pooled as each asks (SamplingParams.pooling) in the same forward as the step's other
rows.

"last" reads the prompt's last position, in the chunk that ends the prompt; "mean" sums
every position over the request's chunks (float32, kept here between steps) and divides at
the last. A chunk that starts at position 0 starts the sum again: a request preempted by
recompute computes its prompt from the start. A sum is dropped when its request ends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.core.outputs import ScheduledRequest


@dataclass
class _Row:
    request_id: str
    pooling: str
    start: int  # where its positions begin among the pooled hidden rows
    count: int
    first: bool  # the chunk starts the prompt
    last: bool  # the chunk ends the prompt
    normalize: bool


def has_pooling(order: list[ScheduledRequest]) -> bool:
    return any(r.sampling_params.pooling is not None for r in order)


class Pooler:
    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}  # mean pooling, so far

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sums.pop(rid, None)

    def forward(
        self,
        model,
        inputs: tuple,
        logits_indices: torch.Tensor,
        order: list[ScheduledRequest],
        offsets: list[int],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The logits of `logits_indices` and the vectors of the embedding requests whose
        prompt this step ends (none in most steps), from one forward of `model` over
        `inputs` (its arguments before the indices; `offsets`: each row's first token in
        the packed batch)."""
        rows, positions = self._plan(order, offsets)
        if not rows:
            return model(*inputs, logits_indices), {}
        pooled_at = torch.tensor(positions, dtype=torch.long, device=logits_indices.device)
        hidden = model(*inputs, torch.cat([logits_indices, pooled_at]), hidden_only=True)
        n = len(logits_indices)
        return model.logits(hidden[:n]), self._pool(rows, hidden[n:])

    def _plan(
        self, order: list[ScheduledRequest], offsets: list[int]
    ) -> tuple[list[_Row], list[int]]:
        rows: list[_Row] = []
        positions: list[int] = []
        for i, r in enumerate(order):
            params = r.sampling_params
            if params.pooling is None:
                continue
            if params.pooling == "last" and not r.pooled:
                continue  # only the prompt's last position counts
            end = offsets[i] + r.num_tokens
            take = range(offsets[i], end) if params.pooling == "mean" else range(end - 1, end)
            first = r.num_computed_tokens == 0
            at = len(positions)
            rows.append(
                _Row(r.request_id, params.pooling, at, len(take), first, r.pooled, params.normalize)
            )
            positions += take
        return rows, positions

    def _pool(self, rows: list[_Row], hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        pooled = {}
        for row in rows:
            h = hidden[row.start : row.start + row.count].float()
            if row.pooling == "mean":
                total, count = (0, 0) if row.first else self._sums.get(row.request_id, (0, 0))
                total, count = h.sum(0) + total, count + row.count
                if not row.last:
                    self._sums[row.request_id] = (total, count)
                    continue
                self._sums.pop(row.request_id, None)
                vector = total / count
            else:
                vector = h[0]
            pooled[row.request_id] = F.normalize(vector, dim=0) if row.normalize else vector
        return pooled
