"""Mixtures of experts (Mixtral, Qwen3-MoE with a dense layer, Qwen2-MoE with a shared expert
and every other layer sparse): greedy tokens equal transformers' generate on tiny random
checkpoints written by each family's own transformers class, alone and in mixed batches,
under chunked prefill, both preemption modes, the prefix cache and speculation; the expert
path groups tokens by expert; what is not served yet is a start error naming its field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.core.errors import InvalidParam
from engine.model.loader import read_spec
from engine.model.sparse_moe import SparseMoE
from tests.conftest import build_engine, tiny_model_dir
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import check_against_oracle, random_prompts, run_mix

FAMILIES = ["mixtral", "qwen3-moe", "qwen2-moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> tuple[str, HFOracle]:
    model = tiny_model_dir(request.param)
    return model, HFOracle(model)


@pytest.mark.parametrize(
    ("scenario", "engine_args"),
    [
        ("alone", {}),  # one request at a time: prefill, then decode steps of one row
        ("mixed", {}),
        ("chunked+preemption", {"preemption_mode": "recompute"}),
        ("swap", {"preemption_mode": "swap"}),
        ("token-major", {}),
    ],
)
def test_moe_greedy_tokens_match_hf(family, scenario, engine_args):
    model, oracle = family
    prompts = random_prompts(11, 8, max_len=40)
    max_tokens = [14] * len(prompts)
    arrive_at = [0, 0, 0, 0, 2, 4, 6, 8]
    sizes = {"block_size": 4, "num_blocks": 80, "max_num_seqs": 8, "max_num_batched_tokens": 32}
    if scenario == "alone":
        sizes["max_num_seqs"] = 1
    if scenario in ("chunked+preemption", "swap"):
        sizes |= {"num_blocks": 36, "max_num_batched_tokens": 9}
    if scenario == "swap":
        sizes["num_host_blocks"] = 64
    block_size, num_blocks = sizes.pop("block_size"), sizes.pop("num_blocks")
    engine = build_engine(model, block_size, num_blocks, **sizes, **engine_args)
    if scenario == "token-major":
        engine.runner.model.unpack_weights()
        engine.runner.model.feature_major_max_tokens = 0
    tokens = run_mix(engine, prompts, max_tokens, arrive_at)
    check_against_oracle(oracle, prompts, max_tokens, tokens)
    if "preemption" in scenario or scenario == "swap":
        assert engine.scheduler.num_preemptions_total > 0


def test_moe_with_prefix_cache_and_speculation_matches_hf(family):
    model, oracle = family
    # Shared prefixes (the cache serves the second of each pair) and repeats (ngram drafts).
    base = random_prompts(5, 4, max_len=24)
    prompts = [p + p[:8] + p[:8] for p in base] + [p + p[:8] + p[:8] + [7, 7] for p in base]
    max_tokens = [12] * len(prompts)
    engine = build_engine(
        model,
        4,
        120,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        speculative={"enabled": True, "method": "ngram", "adaptive": False},
    )
    tokens = run_mix(engine, prompts, max_tokens, [0, 0, 0, 0, 3, 3, 3, 3])
    check_against_oracle(oracle, prompts, max_tokens, tokens)
    assert engine.scheduler.kv_cache.prefix_hits > 0


@torch.no_grad()
def test_the_expert_path_equals_each_tokens_own_experts():
    """Tokens grouped by expert, one GEMM pair per expert: the same sums as running each
    token's top-k experts on it alone."""
    from engine.cpu.decoder_ops import DecoderOps

    spec = read_spec(tiny_model_dir("qwen3-moe"))
    assert spec.moe is not None
    torch.manual_seed(0)
    moe = SparseMoE(spec.hidden_size, spec.moe, None)
    for param in moe.parameters():
        param.data.normal_(0, 0.1)
    x = torch.randn(37, spec.hidden_size)
    weights, experts = moe.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(37))  # norm_topk_prob
    got = moe.experts(x, weights, experts, DecoderOps(False))
    want = torch.zeros_like(x)
    for t in range(len(x)):
        for j in range(spec.moe.top_k):
            e = int(experts[t, j])
            gate, up = (moe.w13[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (moe.w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_moe_does_not_serve_yet_is_a_start_error_naming_the_field(tmp_path: Path):
    model = tiny_model_dir("mixtral")
    with pytest.raises(InvalidParam) as err:
        build_engine(model, 4, 40, tensor_parallel_size=2)
    assert err.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidParam) as err:
        build_engine(model, 4, 40, quantization="fp8")
    assert err.value.param == "quantization"
    odd = tmp_path / "deepseek-like"
    shutil.copytree(model, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(config | {"scoring_func": "sigmoid"}))
    with pytest.raises(ValueError, match=r"config\.json\.scoring_func 'sigmoid'"):
        read_spec(str(odd))
