"""A step's LoRA segments (runs of tokens of one adapter slot) and how they are computed:
the small ones of a run of slots in one batched matmul pair, padded to one length; the rest
one matmul pair each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.core.outputs import ScheduledRequest

if TYPE_CHECKING:
    from engine.lora.triton_kernels import KernelSegments

# Batched only where the padded rows are at most this many times the real ones, for at least
# this many segments (fewer cost less one by one), of at most this many tokens each (longer
# ones are matmuls large enough to pay their call).
MAX_PADDING = 2.5
MIN_BATCHED = 3
MAX_BATCHED_LENGTH = 32


@dataclass
class BatchedSegments:
    first_slot: int
    last_slot: int
    length: int  # each slot's rows, padded
    gather: torch.Tensor  # [slots x length] token of each padded row (padding: any token)
    rows: torch.Tensor  # the real rows among them
    tokens: torch.Tensor  # their tokens
    span: tuple[int, int] | None  # (first, count) where those are consecutive tokens


@dataclass
class LoRAStep:
    """The current step's plan, which every layer's LayerLoRA reads."""

    active: bool = False
    batched: BatchedSegments | None = None
    single: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, start, end)
    kernel: KernelSegments | None = None  # every segment, for the Triton kernels
    parts: set[str] = field(default_factory=set)  # checkpoint layers its adapters adapt
    # [N, n] -> [n, N] contiguous (the decoder's fast transpose where it has one).
    transpose: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.t().contiguous()

    def update(
        self,
        order: list[ScheduledRequest],
        device: torch.device,
        kernel: bool,
        slot_parts: list[set[str]],
    ) -> None:
        """Plan the step whose packed batch holds the rows of `order`, in that order: for
        the Triton kernels (`kernel`), else for the torch path. `slot_parts`: the checkpoint
        layers ("self_attn.q_proj", ...) each slot's adapter adapts."""
        segments = segments_of(order)
        self.parts = set().union(*(slot_parts[slot] for slot, _, _ in segments))
        if kernel and segments:
            from engine.lora.triton_kernels import KernelSegments

            self.active, self.batched, self.single = True, None, []
            self.kernel = KernelSegments(segments, device)
            return
        planned = plan(segments, device)
        self.active, self.batched, self.single = planned.active, planned.batched, planned.single
        self.kernel = None


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


def _batchable(segments: list[tuple[int, int, int]]) -> dict[int, tuple[int, int]] | None:
    """The most segments (slot -> (start, end), one per slot) that one padded batch takes
    within MAX_PADDING: those up to some length m, m the best of the lengths seen; None where
    fewer than MIN_BATCHED fit."""
    best: dict[int, tuple[int, int]] = {}
    for m in sorted({j - i for _, i, j in segments if j - i <= MAX_BATCHED_LENGTH}):
        small: dict[int, tuple[int, int]] = {}
        for slot, i, j in segments:  # a slot's second run goes alone
            if j - i <= m and slot not in small:
                small[slot] = (i, j)
        padded = (max(small) - min(small) + 1) * m
        if padded <= MAX_PADDING * sum(j - i for i, j in small.values()) and len(small) > len(best):
            best = small
    return best if len(best) >= MIN_BATCHED else None


def plan(segments: list[tuple[int, int, int]], device: torch.device) -> LoRAStep:
    """How to compute `segments` ((slot, start, end), in slot order)."""
    if not segments:
        return LoRAStep()
    small = _batchable(segments)
    if small is None:
        return LoRAStep(True, None, segments)
    single = [(slot, i, j) for slot, i, j in segments if small.get(slot) != (i, j)]
    lo, hi = min(small), max(small)
    m = max(j - i for i, j in small.values())
    gather, rows, tokens = [], [], []
    for slot in range(lo, hi + 1):
        i, j = small.get(slot, (0, 0))
        rows += range(len(gather), len(gather) + j - i)
        tokens += range(i, j)
        gather += list(range(i, j)) + [0] * (m - (j - i))

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    span = (
        (tokens[0], len(tokens))
        if tokens == list(range(tokens[0], tokens[0] + len(tokens)))
        else None
    )
    batched = BatchedSegments(lo, hi, m, tensor(gather), tensor(rows), tensor(tokens), span)
    return LoRAStep(True, batched, single)
