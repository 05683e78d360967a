"""The speculative graph path on the CPU (the `triton` backend under Triton's interpreter,
tests/engine/replayed_graphs.py's replay semantics): rows of a last token and its drafts,
padded to k + 1 query tokens and to a captured batch size, compute what the eager step
computes, write no real slot beyond their own, and a speculating engine whose decode steps
replay them changes no token."""

from __future__ import annotations

import os
import random

import pytest
import torch

# NOTE: read when the kernels are defined, so before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.core.fixed_proposers import ReplayProposer  # noqa: E402
from engine.core.outputs import ScheduledRequest  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.model.weight_loader import load_decoder  # noqa: E402
from engine.runner.decode_inputs import DecodeInputs, decode_forward  # noqa: E402
from tests.conftest import build_engine  # noqa: E402
from tests.engine.replayed_graphs import replay_spec_decodes  # noqa: E402
from tests.engine.test_speculative_decoding import (  # noqa: E402
    FIXED_K,
    greedy,
    repetitive_prompts,
    run,
    sampled,
)

BLOCK = 4
Q = 3  # a last token and up to two drafts
# (context, tokens in the row): a decode, full and partial drafted rows, one at position 0.
ROWS = [(5, 1), (13, 3), (0, 2), (30, 3), (7, 2)]


@pytest.fixture
def setup(tiny_model):
    engine = build_engine(tiny_model, BLOCK, 40, attention_backend="triton")
    runner = engine.runner
    runner.model = load_decoder(
        tiny_model, runner.spec, torch.device("cpu"), torch.float32, native_ops=False
    )
    runner.backend = TritonAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    blocks = list(range(runner.num_kv_blocks()))
    random.Random(2).shuffle(blocks)
    order = []
    for i, (context, n) in enumerate(ROWS):
        need = (context + n - 1) // BLOCK + 1
        ids, blocks = blocks[:need], blocks[need:]
        tokens = [100 + i + j for j in range(n)]
        row = ScheduledRequest(f"r{i}", tokens, context, ids, True, SamplingParams(), 0)
        row.num_drafts = n - 1
        order.append(row)
    return runner, order


def _positions(order) -> list[int]:
    return [i * Q + j for i, r in enumerate(order) for j in range(r.num_tokens)]


@torch.inference_mode()
def test_drafted_rows_padded_to_the_graph_shape_compute_what_the_eager_step_does(setup):
    runner, order = setup
    before = [k.clone() for k, _ in runner.kv_caches]
    input_ids, positions, layout, logits_at = runner.prepare_inputs(order)
    metadata = runner.backend.prepare(layout)
    eager = runner.model(input_ids, positions, runner.kv_caches, runner.backend, metadata,
                         logits_at, True)  # fmt: skip
    inputs = DecodeInputs.allocate(8, 16, runner.device, tokens_per_row=Q)
    inputs.fill(order, 8, BLOCK, runner.scratch_block)
    padded = decode_forward(runner.model, runner.backend, inputs, runner.kv_caches, None)
    assert padded.shape[0] == 8 * Q
    torch.testing.assert_close(padded[_positions(order)], eager, rtol=1e-4, atol=1e-4)
    # Only the rows' own slots and the scratch block changed.
    real = {
        r.block_ids[p // BLOCK] * BLOCK + p % BLOCK
        for r in order
        for p in range(r.num_computed_tokens, r.num_computed_tokens + r.num_tokens)
    }
    scratch = set(range(runner.scratch_block * BLOCK, (runner.scratch_block + 1) * BLOCK))
    for old, (new, _) in zip(before, runner.kv_caches, strict=True):
        old_slots, new_slots = old.view(-1, *old.shape[2:]), new.view(-1, *new.shape[2:])
        changed = set((old_slots != new_slots).flatten(1).any(1).nonzero().flatten().tolist())
        assert changed <= real | scratch and real <= changed


def test_a_speculating_engine_replaying_drafted_rows_changes_no_token(tiny_model):
    prompts = repetitive_prompts(37, 6)
    params = greedy([14] * 3) + sampled(3, seed=37)
    common = {"attention_backend": "triton", "max_num_seqs": 8}
    plain = run(build_engine(tiny_model, **common), prompts, params)
    engine = build_engine(tiny_model, speculative=FIXED_K, **common)
    graphs = replay_spec_decodes(engine, largest=8)
    outputs = {rid: got[0] for rid, got in plain.items()}  # drafts every step, some wrong
    vocab = engine.runner_vocab_size()
    engine.scheduler.speculator.proposer = ReplayProposer(outputs, 0.6, vocab)
    assert run(engine, prompts, params) == plain
    assert sum(graphs.replays().values()) > 5, graphs.replays()
    assert engine.stats().spec.num_draft_tokens > 0
