"""A step's LoRA segments (runs of tokens of one adapter slot) and how they are computed:
the small ones of a run of slots in one batched matmul pair, padded to one length; the rest
one matmul pair each."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from engine.core.outputs import ScheduledRequest

# Batched only where the padded rows are at most this many times the real ones, and for at
# least this many segments (fewer cost less one by one).
MAX_PADDING = 2.5
MIN_BATCHED = 3


@dataclass
class BatchedSegments:
    first_slot: int
    last_slot: int
    length: int  # each slot's rows, padded
    gather: torch.Tensor  # [slots x length] token of each padded row (padding: any token)
    rows: torch.Tensor  # the real rows among them
    tokens: torch.Tensor  # their tokens


@dataclass
class LoRAStep:
    """The current step's plan, which every layer's LayerLoRA reads."""

    active: bool = False
    batched: BatchedSegments | None = None
    single: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end)

    def update(self, order: list[ScheduledRequest], device: torch.device) -> None:
        """Plan the step whose packed batch holds the rows of `order`, in that order."""
        planned = plan(segments_of(order), device)
        self.active, self.batched, self.single = planned.active, planned.batched, planned.single


def segments_of(order: list[ScheduledRequest]) -> list[tuple[int, int, int]]:
    """(slot, start, end) of each run of tokens of one adapter, in slot order."""
    segments: list[tuple[int, int, int]] = []
    start = 0
    for r in order:
        end = start + r.num_tokens
        if r.lora_slot >= 0:
            if segments and segments[-1][0] == r.lora_slot and segments[-1][2] == start:
                segments[-1] = (r.lora_slot, segments[-1][1], end)
            else:
                segments.append((r.lora_slot, start, end))
        start = end
    return sorted(segments)


def plan(segments: list[tuple[int, int, int]], device: torch.device) -> LoRAStep:
    """How to compute `segments` ((slot, start, end), in slot order)."""
    if not segments:
        return LoRAStep()
    lengths = [j - i for _, i, j in segments]
    cap = max(1, 2 * int(statistics.median(lengths)))
    small: dict[int, tuple[int, int]] = {}
    single = []
    for slot, i, j in segments:  # long ones, and a slot's second run, go one by one
        if j - i <= cap and slot not in small:
            small[slot] = (i, j)
        else:
            single.append((slot, i, j))
    if len(small) < MIN_BATCHED:
        return LoRAStep(True, None, segments)
    lo, hi = min(small), max(small)
    m = max(j - i for i, j in small.values())
    real = sum(j - i for i, j in small.values())
    if (hi - lo + 1) * m > MAX_PADDING * real:
        return LoRAStep(True, None, segments)
    gather, rows, tokens = [], [], []
    for slot in range(lo, hi + 1):
        i, j = small.get(slot, (0, 0))
        rows += range(len(gather), len(gather) + j - i)
        tokens += range(i, j)
        gather += list(range(i, j)) + [0] * (m - (j - i))

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    batched = BatchedSegments(lo, hi, m, tensor(gather), tensor(rows), tensor(tokens))
    return LoRAStep(True, batched, single)
