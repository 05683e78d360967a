"""A step's LoRA deltas: batched (padded) and one-by-one segments, feature-major and
token-major, all equal each token's own x A^T B^T."""

from __future__ import annotations

import pytest
import torch

from engine.lora.layer_lora import LayerLoRA
from engine.lora.segments import plan

SLOTS, RANK, IN, PARTS = 6, 4, 24, (10, 6, 6)


def weights(gen: torch.Generator):
    a = torch.randn(SLOTS, IN, len(PARTS) * RANK, generator=gen)
    rows = [0, PARTS[0], PARTS[0] + PARTS[1]]
    bs = [
        (f"part{p}", row, torch.randn(SLOTS, RANK, n, generator=gen))
        for p, (row, n) in enumerate(zip(rows, PARTS, strict=True))
    ]
    return a, bs


def layout(lengths: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """(slot, tokens) runs (slot -1: no adapter) -> each token's slot, and the segments."""
    slot_of_token = [slot for slot, n in lengths for _ in range(n)]
    segments, start = [], 0
    for slot, n in lengths:
        if slot >= 0:
            segments.append((slot, start, start + n))
        start += n
    return slot_of_token, segments


def reference(a, bs, x, slot_of_token):
    """Token-major [T, out] deltas, token by token."""
    out = torch.zeros(len(slot_of_token), sum(PARTS))
    for t, slot in enumerate(slot_of_token):
        if slot < 0:
            continue
        shrunk = x[t] @ a[slot]
        for p, (_, row, b) in enumerate(bs):
            out[t, row : row + b.shape[2]] = shrunk[p * RANK : (p + 1) * RANK] @ b[slot]
    return out


@pytest.mark.parametrize(
    ("lengths", "batched"),
    [
        ([(0, 3), (1, 2), (2, 4), (4, 3)], True),  # small runs of several slots: one bmm
        ([(0, 2), (1, 2), (2, 2), (3, 40)], True),  # a long run goes alone, the rest batched
        ([(1, 5), (3, 1)], False),  # too few to batch
        ([(0, 2), (-1, 3), (5, 1), (2, 1)], False),  # 6 slots x 2 rows padded for 4: alone
    ],
)
@pytest.mark.parametrize("dim", [0, 1])
def test_segments_give_each_tokens_own_delta(lengths, batched, dim):
    gen = torch.Generator().manual_seed(len(lengths) + dim)
    a, bs = weights(gen)
    slot_of_token, segments = layout(lengths)
    step = plan(sorted(segments), torch.device("cpu"))
    step.parts = {name for name, _, _ in bs}
    assert (step.batched is not None) == batched
    x = torch.randn(len(slot_of_token), IN, generator=gen)
    base = torch.randn(len(slot_of_token), sum(PARTS), generator=gen)
    out = base.clone() if dim == 0 else base.t().contiguous()
    LayerLoRA(step, {"m": (a, bs)}).add("m", out, x if dim == 0 else x.t().contiguous(), dim)
    got = out if dim == 0 else out.t()
    torch.testing.assert_close(got, base + reference(a, bs, x, slot_of_token), rtol=1e-4, atol=1e-4)


def test_parts_no_adapter_of_the_step_adapts_are_skipped():
    gen = torch.Generator().manual_seed(3)
    a, bs = weights(gen)
    segments = [(0, 0, 3), (1, 3, 5), (2, 5, 9)]
    step = plan(segments, torch.device("cpu"))
    step.parts = {"part0", "part2"}  # part1's weights are skipped as if zeros
    x = torch.randn(9, IN, generator=gen)
    out = torch.zeros(9, sum(PARTS))
    LayerLoRA(step, {"m": (a, bs)}).add("m", out, x)
    want = reference(a, bs, x, [0] * 3 + [1] * 2 + [2] * 4)
    want[:, PARTS[0] : PARTS[0] + PARTS[1]] = 0
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    step.parts = set()
    LayerLoRA(step, {"m": (a, bs)}).add("m", out := torch.zeros(9, sum(PARTS)), x)
    assert not out.any()
