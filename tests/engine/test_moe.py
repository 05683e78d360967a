"""Mixtures of experts (Mixtral, Qwen3-MoE with a dense layer, Qwen2-MoE with a shared expert
and every other layer sparse, gpt-oss with attention sinks, windowed and full layers, YaRN and
biased clamped experts): greedy tokens equal transformers' generate on tiny random
checkpoints written by each family's own transformers class, alone and in mixed batches,
under chunked prefill, both preemption modes, the prefix cache and speculation; the expert
path groups tokens by expert; tensor and expert parallelism (gloo) give one rank's tokens,
each rank reading only its experts; what is not served yet is a start error naming its field."""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.core.errors import InvalidParam
from engine.model.loader import read_spec
from engine.model.sharding import Shard, shard_spec
from engine.model.sparse_moe import SparseMoE
from engine.model.tiny_model import make_model
from engine.model.weight_loader import load_decoder
from tests.conftest import REPO, build_engine, tiny_model_dir
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import check_against_oracle, random_prompts, run_mix


@pytest.fixture(scope="module")
def oracles() -> dict[str, HFOracle]:
    return {}


def _oracle(oracles: dict[str, HFOracle], family: str) -> tuple[str, HFOracle]:
    model = tiny_model_dir(family)
    if family not in oracles:
        oracles[family] = HFOracle(model)
    return model, oracles[family]


# Every family mixed, chunked and preempted; the other paths once each.
@pytest.mark.parametrize(
    ("family", "scenario"),
    [
        ("mixtral", "chunked+preemption"),
        ("qwen3-moe", "chunked+preemption"),
        ("qwen2-moe", "chunked+preemption"),
        ("gpt-oss", "chunked+preemption"),
        ("mixtral", "alone"),  # one request at a time: decode steps of one row
        ("qwen3-moe", "swap"),
        ("qwen2-moe", "token-major"),
    ],
)
def test_moe_greedy_tokens_match_hf(oracles, family, scenario):
    model, oracle = _oracle(oracles, family)
    prompts = random_prompts(11, 8, max_len=40)
    max_tokens = [14] * len(prompts)
    arrive_at = [0, 0, 0, 0, 2, 4, 6, 8]
    sizes = {"block_size": 4, "num_blocks": 80, "max_num_seqs": 8, "max_num_batched_tokens": 32}
    engine_args = {}
    if scenario == "alone":
        sizes["max_num_seqs"] = 1
    if scenario in ("chunked+preemption", "swap"):
        sizes |= {"num_blocks": 36, "max_num_batched_tokens": 9}
    if scenario == "swap":
        sizes["num_host_blocks"] = 64
        engine_args["preemption_mode"] = "swap"
    block_size, num_blocks = sizes.pop("block_size"), sizes.pop("num_blocks")
    engine = build_engine(model, block_size, num_blocks, **sizes, **engine_args)
    if scenario == "token-major":
        engine.runner.model.unpack_weights()
        engine.runner.model.feature_major_max_tokens = 0
    tokens = run_mix(engine, prompts, max_tokens, arrive_at)
    check_against_oracle(oracle, prompts, max_tokens, tokens)
    if scenario in ("chunked+preemption", "swap"):
        assert engine.scheduler.num_preemptions_total > 0


def test_moe_with_prefix_cache_and_speculation_matches_hf(oracles):
    model, oracle = _oracle(oracles, "qwen2-moe")
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
        build_engine(model, 4, 40, lora={})
    assert err.value.param == "lora"
    spec = read_spec(model)
    assert spec.moe is not None
    odd = replace(spec, moe=replace(spec.moe, num_experts=7))
    with pytest.raises(InvalidParam, match=r"must divide the model's num_experts \(7\)"):
        shard_spec(odd, 2, expert_parallel=True)
    gpt_oss = read_spec(tiny_model_dir("gpt-oss"))
    with pytest.raises(InvalidParam) as err:
        shard_spec(gpt_oss, 2, expert_parallel=False)
    assert err.value.param == "expert_parallel"
    mxfp4 = tmp_path / "mxfp4-mixtral"
    shutil.copytree(model, mxfp4)
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidParam, match="gpt-oss's experts only") as err:
        read_spec(str(mxfp4))
    assert err.value.param == "quantization_config.quant_method"
    odd = tmp_path / "deepseek-like"
    shutil.copytree(model, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(config | {"scoring_func": "sigmoid"}))
    with pytest.raises(ValueError, match=r"config\.json\.scoring_func 'sigmoid'"):
        read_spec(str(odd))


def _wide_moe() -> str:
    """Qwen3-MoE with 8 heads and 4 KV heads: worlds of 2 and 4 divide it."""
    return str(make_model(REPO / "models" / "tiny-wide-qwen3-moe", "tiny-wide", "qwen3-moe"))


@functools.cache
def _mix(model: str, world: int, expert_parallel: bool) -> dict[int, list[int]]:
    engine = build_engine(
        model,
        4,
        120,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        tensor_parallel_size=world,
        expert_parallel=expert_parallel,
    )
    try:
        prompts = random_prompts(4, 8, max_len=30)
        return run_mix(engine, prompts, [10] * len(prompts), [0, 0, 0, 1, 2, 3, 4, 5])
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("arch", "world", "expert_parallel"),
    [
        ("mixtral", 2, False),  # every expert's columns split
        ("qwen2-moe", 2, True),  # experts whole, the shared expert's columns split
        ("gpt-oss", 2, True),  # sinks split by heads, o_proj's bias counted once
        ("wide-qwen3-moe", 4, True),
    ],
)
def test_tensor_and_expert_parallel_give_one_ranks_tokens(arch, world, expert_parallel):
    model = _wide_moe() if arch.startswith("wide") else tiny_model_dir(arch)
    assert _mix(model, world, expert_parallel) == _mix(model, 1, False)


@pytest.mark.parametrize("world", [2, 4])
def test_under_expert_parallelism_each_rank_reads_only_its_experts(world):
    model = _wide_moe()
    spec = read_spec(model)
    assert spec.moe is not None
    cpu = torch.device("cpu")
    whole = load_decoder(model, spec, cpu, torch.float32, native_ops=False)
    held = spec.moe.num_experts // world
    for rank in range(world):
        tp = _Sharded(Shard(rank, world, expert_parallel=True))
        part = load_decoder(model, spec, cpu, torch.float32, native_ops=False, tp=tp)
        assert abs(part.loaded_bytes / whole.loaded_bytes - 1 / world) < 0.02
        experts = slice(rank * held, (rank + 1) * held)
        mine, all_of_them = part.layers[0].mlp, whole.layers[0].mlp  # (layer 1 is dense)
        assert mine.w13.shape[0] == held and mine.first_expert == rank * held
        torch.testing.assert_close(mine.w13, all_of_them.w13[experts])
        torch.testing.assert_close(mine.w2, all_of_them.w2[experts])
        torch.testing.assert_close(mine.gate.weight, all_of_them.gate.weight)


class _Sharded:
    """What the loader reads of a TensorParallel: only its shard (loading runs no collective)."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard


@pytest.mark.parametrize(
    ("shape", "quant"),
    [("qwen3-moe-mini", None), ("qwen3-moe-mini", "fp8-block"), ("gpt-oss-mini", None)],
)
def test_a_random_checkpoint_of_a_moe_shape_serves_as_transformers_reads_it(tmp_path, shape, quant):
    """engine/model/random_checkpoint.py's MoE shapes (the GPU stage's 12-layer Qwen3-30B-A3B
    and gpt-oss-20b are such): per-expert weights under the real names (or in FP8 blocks, as
    Qwen3-30B-A3B-FP8 has them), or gpt-oss's stacked MXFP4 experts (dequantized at load, as
    transformers dequantizes them), which transformers loads too."""
    from engine.model.random_checkpoint import make_random_checkpoint

    gpt_oss = shape.startswith("gpt-oss")  # (AutoTokenizer needs its files for gpt-oss)
    checkpoint = make_random_checkpoint(
        tmp_path / "moe", shape, torch.float32, quant=quant, tokenizer=gpt_oss
    )
    model = str(checkpoint)
    prompts = random_prompts(9, 4, max_len=20)
    engine = build_engine(model, 4, 60, max_num_seqs=4, max_num_batched_tokens=32)
    tokens = run_mix(engine, prompts, [6] * 4, [0, 0, 1, 1])
    check_against_oracle(HFOracle(model), prompts, [6] * 4, tokens)


def test_embeddings_of_a_moe_model_equal_transformers_hidden_states():
    """Embedding requests beside generating ones on a mixture of experts: its final hidden
    states pooled, as transformers computes them."""
    import torch.nn.functional as F
    from transformers import AutoModel

    from engine.core.sampling_params import SamplingParams
    from tests.engine.test_embeddings import PROMPTS, embed

    model = tiny_model_dir("qwen2-moe")
    hf = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    engine = build_engine(model, 4, 120, max_num_seqs=8, max_num_batched_tokens=24)
    params = SamplingParams(max_tokens=1, pooling="last", normalize=True)
    vectors, _ = embed(engine, PROMPTS, params, generate=PROMPTS[:2])
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            hidden = hf(torch.tensor([prompt])).last_hidden_state[0]
        want = F.normalize(hidden[-1], dim=0)
        torch.testing.assert_close(vectors[f"e{i}"], want, rtol=1e-4, atol=1e-5)
