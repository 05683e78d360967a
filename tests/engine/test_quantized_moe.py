"""Quantized mixtures of experts: block-FP8 checkpoints in Qwen3-30B-A3B-FP8's layout (each
expert's weight_scale_inv), compressed-tensors FP8 blocks, AWQ and GPTQ experts, and online
FP8, each expert held quantized (one quantized gate/up and down per expert) and the routers
float; greedy tokens equal transformers' generate on the dequantized twin, under chunked
prefill and preemption, at 1 rank and at 2 (experts whole per rank, or split by columns);
what cannot be served is a start error naming its field."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.errors import InvalidParam
from engine.model.loader import read_spec
from engine.model.sharding import Shard
from engine.model.sparse_moe import SparseMoE, moe_layers
from engine.model.tiny_model import make_model
from engine.model.weight_loader import load_decoder
from engine.quant.checkpoint_writer import write_quantized
from engine.quant.linear import QuantizedLinear
from tests.conftest import REPO, build_engine, tiny_model_dir
from tests.engine.oracle import HFOracle
from tests.engine.test_moe import _Sharded
from tests.engine.test_oracle import check_against_oracle, random_prompts, run_mix, scenario_engine

CPU = torch.device("cpu")


def quant_moe_model(arch: str, fmt: str) -> tuple[str, str]:
    """(a tiny `arch` mixture of experts quantized as `fmt`, its dequantized float32 twin),
    written once under models/: hidden size 256 and experts 128 wide (Mixtral's: 512), which
    128x128 FP8 blocks and INT4 groups of 128 tile."""
    overrides = {} if arch == "mixtral" else {"moe_intermediate_size": 128}
    src = make_model(REPO / "models" / f"tiny-quant-{arch}", "tiny-quant", arch, 0, overrides)
    out, twin = write_quantized(src, REPO / "models" / "quant" / f"{fmt}-{arch}", fmt)
    return str(out), str(twin)


def _experts(moe: SparseMoE) -> list[QuantizedLinear]:
    assert moe.expert_mlps is not None
    layers = [m for mlp in moe.expert_mlps for m in (mlp.gate_up_proj, mlp.down_proj)]
    assert all(isinstance(layer, QuantizedLinear) for layer in layers)
    return layers


@pytest.mark.parametrize(
    ("arch", "fmt", "world", "expert_parallel"),
    [
        ("qwen3-moe", "fp8-block", 1, False),  # Qwen3-30B-A3B-FP8's layout
        ("qwen2-moe", "ct-fp8-block", 1, False),  # its shared expert quantized too
        ("mixtral", "awq", 1, False),  # w1/w3/w2 experts
        ("qwen3-moe", "online-fp8", 2, True),  # experts whole per rank, scaled at load
        ("mixtral", "gptq-asym-actorder", 2, False),  # every expert split by columns
    ],
)
def test_quantized_moe_greedy_tokens_equal_hf_on_the_dequantized_model(
    arch, fmt, world, expert_parallel
):
    model, twin = quant_moe_model(arch, fmt)
    online = {"quantization": "fp8"} if fmt == "online-fp8" else {}
    engine = scenario_engine(
        model,
        "chunked+preemption",
        tensor_parallel_size=world,
        expert_parallel=expert_parallel,
        **online,
    )
    try:
        layers = moe_layers(engine.runner.model)
        assert layers and all(layer.w13 is None and _experts(layer) for layer in layers)
        rng = random.Random(world)
        prompts = random_prompts(world, 10, max_len=40)
        max_tokens = [rng.randint(8, 20) for _ in prompts]
        tokens = run_mix(engine, prompts, max_tokens, [rng.randint(0, 3) for _ in prompts])
        assert engine.scheduler.num_preemptions_total > 0
    finally:
        engine.close()
    check_against_oracle(HFOracle(twin), prompts, max_tokens, tokens)


def test_each_expert_is_held_in_fp8_and_each_rank_reads_only_its_experts():
    """Block-FP8 experts stay FP8 with their block scales (the float stacked weights are
    gone), computing with the weights transformers' fine-grained FP8 loader reads from the
    same file; under expert parallelism each rank reads and holds only its experts."""
    from transformers import AutoModelForCausalLM

    model, _ = quant_moe_model("qwen3-moe", "fp8-block")
    spec = read_spec(model)
    assert spec.moe is not None
    whole = load_decoder(model, spec, CPU, torch.float32, native_ops=False)
    theirs = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    experts = theirs.model.layers[0].mlp.experts  # stacked: gate_up_proj [E, 2I, H]
    moe = whole.layers[0].mlp  # (layer 1 is dense)
    assert isinstance(moe, SparseMoE) and moe.w13 is None and moe.w2 is None
    for e, mlp in enumerate(moe.expert_mlps or []):
        assert mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
        assert mlp.gate_up_proj.weight_scale.shape == (2, 2)  # [2*128 rows, 256 columns] / 128
        assert torch.equal(mlp.gate_up_proj.dequantized(), experts.gate_up_proj[e])
        assert torch.equal(mlp.down_proj.dequantized(), experts.down_proj[e])
    held = spec.moe.num_experts // 2
    read = 0
    for rank in range(2):
        part = load_decoder(
            model, spec, CPU, torch.float32, native_ops=False,
            tp=_Sharded(Shard(rank, 2, expert_parallel=True)),
        )  # fmt: skip
        mine = part.layers[0].mlp
        assert isinstance(mine, SparseMoE) and mine.first_expert == rank * held
        pairs = zip(_experts(mine), _experts(moe)[2 * rank * held :], strict=False)
        for got, want in pairs:
            assert torch.equal(got.weight, want.weight)
            assert torch.equal(got.weight_scale, want.weight_scale)
        read += part.loaded_bytes
    # The ranks together read the checkpoint once, but for what each reads whole (norms and
    # routers): experts as much as heads and vocabulary rows are read by one rank only.
    tensors = load_file(f"{model}/model.safetensors")
    whole_per_rank = sum(t.nbytes for n, t in tensors.items() if "norm" in n or ".mlp.gate." in n)
    assert read == whole.loaded_bytes + whole_per_rank


def test_what_quantized_moe_cannot_serve_is_a_start_error_naming_the_field(tmp_path: Path):
    # gpt-oss: float or MXFP4 only.
    with pytest.raises(InvalidParam) as err:
        build_engine(tiny_model_dir("gpt-oss"), 4, 40, quantization="fp8")
    assert err.value.param == "quantization"
    model, _ = quant_moe_model("qwen3-moe", "fp8-block")
    spec = read_spec(model)
    # Experts split by columns would cut 128x128 blocks (64 rows per rank).
    with pytest.raises(InvalidParam, match="not a multiple of its quantization unit") as err:
        load_decoder(model, spec, CPU, torch.float32, tp=_Sharded(Shard(0, 2)))
    assert err.value.param == "tensor_parallel_size"
    # Experts 96 wide: their gate and up rows, fused, would share a 128-row block.
    src = make_model(tmp_path / "narrow-float", "tiny-quant", "qwen3-moe")
    narrow, _ = write_quantized(src, tmp_path / "narrow", "fp8-block")
    with pytest.raises(InvalidParam, match="gate_proj has 96 output rows") as err:
        load_decoder(str(narrow), read_spec(str(narrow)), CPU, torch.float32)
    assert err.value.param == "model"
    # One expert left float among quantized ones.
    partly = tmp_path / "partly"
    shutil.copytree(model, partly)
    config = json.loads((partly / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append(
        "model.layers.0.mlp.experts.3.up_proj"
    )
    (partly / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidParam) as err:
        load_decoder(str(partly), read_spec(str(partly)), CPU, torch.float32)
    assert err.value.param == "quantization_config.ignore"
    # A router stored in FP8 (the engine keeps routers float): no silent cast.
    fp8_router = tmp_path / "fp8-router"
    shutil.copytree(model, fp8_router)
    weights = load_file(fp8_router / "model.safetensors")
    router = "model.layers.0.mlp.gate.weight"
    weights[router] = weights[router].to(torch.float8_e4m3fn)
    save_file(weights, fp8_router / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"weight {router} is torch.float8_e4m3fn"):
        load_decoder(str(fp8_router), spec, CPU, torch.float32)
