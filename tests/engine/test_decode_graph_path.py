"""The decode path CUDA graphs capture, checked on CPU: padding rows change no real row and
write no real cache slot, the padded path computes what the eager step computes, and the
whole decode forward compiles with torch.compile(fullgraph=True) (no graph break, no host
synchronisation inside). Graph capture and replay themselves are checked in tests/gpu."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.model.weight_loader import load_decoder
from engine.runner.decode_inputs import DecodeInputs, capture_sizes, decode_forward
from tests.conftest import build_engine

BLOCK = 4
CONTEXTS = [5, 13, 0, 30]


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 50, 128, 256])
def test_capture_sizes_cover_every_batch_up_to_max_num_seqs(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    assert sizes[: min(4, len(sizes))] == [1, 2, 4, 8][: min(4, len(sizes))] or max_num_seqs < 8
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:], strict=False))


@pytest.fixture(scope="module")
def setup(tiny_model):
    """A runner with a token-major, torch-only decoder (what runs on CUDA) and a cache of
    random contents, and decode requests over scattered blocks."""
    engine = build_engine(tiny_model, BLOCK, 40)
    runner = engine.runner
    runner.model = load_decoder(
        tiny_model, runner.spec, torch.device("cpu"), torch.float32, native_ops=False
    )
    runner.backend = TorchAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    blocks = list(range(runner.num_kv_blocks()))
    random.Random(1).shuffle(blocks)
    order = []
    for i, context in enumerate(CONTEXTS):
        n = context // BLOCK + 1
        ids, blocks = blocks[:n], blocks[n:]
        order.append(ScheduledRequest(f"r{i}", [100 + i], context, ids, True, SamplingParams(), 0))
    return runner, order


def _decode(runner, order, padded: int) -> torch.Tensor:
    inputs = DecodeInputs.allocate(padded, 16, runner.device)
    inputs.fill(order, padded, BLOCK, runner.scratch_block)
    return decode_forward(
        runner.model, runner.backend, inputs, runner.kv_caches, runner.spec.sliding_window
    )


def _eager(runner, order) -> torch.Tensor:
    input_ids, positions, layout, logits_at = runner.prepare_inputs(order)
    metadata = runner.backend.prepare(layout)
    return runner.model(
        input_ids, positions, runner.kv_caches, runner.backend, metadata, logits_at, True
    )


def _real_slots(order) -> set[int]:
    return {
        r.block_ids[r.num_computed_tokens // BLOCK] * BLOCK + r.num_computed_tokens % BLOCK
        for r in order
    }


@torch.inference_mode()
def test_padding_rows_change_no_real_row_and_write_no_real_slot(setup):
    runner, order = setup
    before = [k.clone() for k, _ in runner.kv_caches]
    eager = _eager(runner, order)
    exact = _decode(runner, order, len(order))
    padded = _decode(runner, order, 8)
    assert padded.shape[0] == 8
    torch.testing.assert_close(exact, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[: len(order)], exact, rtol=1e-5, atol=1e-5)
    # Only the real rows' new slots and the scratch block changed.
    touched = _real_slots(order)
    scratch = range(runner.scratch_block * BLOCK, (runner.scratch_block + 1) * BLOCK)
    for old, (new, _) in zip(before, runner.kv_caches, strict=True):
        old_slots, new_slots = old.view(-1, *old.shape[2:]), new.view(-1, *new.shape[2:])
        changed = (old_slots != new_slots).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= touched | set(scratch)
        assert touched <= set(changed)


def test_the_decode_forward_compiles_whole(setup):
    """fullgraph=True fails on any graph break, `.item()` or `.tolist()` included."""
    runner, order = setup
    inputs = DecodeInputs.allocate(8, 16, runner.device)
    inputs.fill(order, 8, BLOCK, runner.scratch_block)
    compiled = torch.compile(decode_forward, fullgraph=True, dynamic=False)
    with torch.no_grad():
        want = decode_forward(runner.model, runner.backend, inputs, runner.kv_caches, None)
        got = compiled(runner.model, runner.backend, inputs, runner.kv_caches, None)
    torch.testing.assert_close(got[: len(order)], want[: len(order)], rtol=1e-4, atol=1e-4)
