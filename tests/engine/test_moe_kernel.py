"""The fused-MoE Triton kernels (engine/model/moe_kernel.py) under Triton's interpreter: the
device-built block layout holds every pair once, in its expert's blocks, at sizes that depend
on the token count only; the two grouped GEMMs equal the grouped torch path, also for the
experts one rank of an expert-parallel model holds."""

from __future__ import annotations

import os

import pytest
import torch

# NOTE: read when the kernels are defined, so before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.cpu.decoder_ops import DecoderOps  # noqa: E402
from engine.model.moe_config import MoESpec  # noqa: E402
from engine.model.moe_kernel import block_layout, fused_experts  # noqa: E402
from engine.model.sparse_moe import SparseMoE  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 48, 40, 8, 2  # widths off the kernels' tiles


def _moe(held: int = EXPERTS, first: int = 0, seed: int = 0) -> SparseMoE:
    spec = MoESpec(EXPERTS, TOP_K, INTER, True, False, (True,), experts_held=held % EXPERTS)
    gen = torch.Generator().manual_seed(seed)
    moe = SparseMoE(HIDDEN, spec, None, first)
    for param in moe.parameters():
        param.data.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return moe


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_the_block_layout_holds_every_pair_once_in_its_experts_blocks(tokens):
    gen = torch.Generator().manual_seed(tokens)
    experts = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    for first, held in ((0, EXPERTS), (4, 4)):
        pairs, block_expert = block_layout(experts, first, held, block_m=4)
        num_pairs = tokens * TOP_K
        assert block_expert.numel() == -(-num_pairs // 4) + held  # the token count's alone
        flat = experts.reshape(-1)
        seen = []
        for block, expert in enumerate(block_expert.tolist()):
            ids = [p for p in pairs[block * 4 : (block + 1) * 4].tolist() if p < num_pairs]
            if expert < 0:
                assert not ids
            assert all(int(flat[p]) == first + expert for p in ids)
            seen += ids
        mine = [p for p in range(num_pairs) if first <= int(flat[p]) < first + held]
        assert sorted(seen) == mine


@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize(("first", "held"), [(0, EXPERTS), (4, 4), (2, 2)])
def test_fused_experts_equal_the_grouped_torch_path(tokens, first, held):
    moe = _moe(held, first, seed=tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(100 + tokens))
    weights, experts = moe.route(x)
    want = moe.experts(x, weights, experts, DecoderOps(False))
    got = fused_experts(x, moe.w13, moe.w2, weights, experts, first)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("broken", [False, True])
def test_the_self_check_passes_the_kernels_or_takes_them_back(monkeypatch, broken):
    """On the CPU, the kernels switched on as on CUDA: the check's `moe` part passes them
    (and the engine then serves transformers' tokens through them), or a wrong kernel falls
    back to the grouped torch path for every layer."""
    from engine.model import moe_kernel
    from engine.model.sparse_moe import moe_layers
    from tests.conftest import build_engine, tiny_model_dir
    from tests.engine.oracle import HFOracle
    from tests.engine.test_oracle import check_against_oracle, random_prompts, run_mix

    model = tiny_model_dir("qwen3-moe")
    engine = build_engine(model, 4, 60, max_num_seqs=4, max_num_batched_tokens=24)
    layers = moe_layers(engine.runner.model)
    for layer in layers:
        layer.kernel = True
    if broken:  # every expert's output dropped
        monkeypatch.setattr(moe_kernel, "fused_experts", lambda x, *args: torch.zeros_like(x))
    (check,) = engine.runner.check_kernels()
    assert (check.part, check.result) == ("moe", "fallback" if broken else "pass")
    assert all(layer.kernel is not broken for layer in layers)
    prompts = random_prompts(2, 4, max_len=20)
    tokens = run_mix(engine, prompts, [6] * 4, [0, 0, 1, 2])
    check_against_oracle(HFOracle(model), prompts, [6] * 4, tokens)
