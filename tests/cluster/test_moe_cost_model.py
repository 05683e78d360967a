"""The simulator prices a mixture of experts as it runs: FLOPs of the experts each token
chose, bytes of the experts a step's tokens touch (E·(1-(1-k/E)^tokens): few at decode batch
1, all of them at a large batch), memory for every expert; the tuner takes the MoE specs."""

from __future__ import annotations

import pytest

from cluster.tune.cli import main as tune_main
from cluster.workload import make_workload
from engine.core.outputs import ScheduledRequest, SchedulerOutput
from engine.core.sampling_params import SamplingParams
from engine.runner.cost_model import GPUS, MODELS, CostParams, step_cost
from engine.runner.model_specs import ModelSpec


def _decode_step(batch: int, context: int = 512) -> SchedulerOutput:
    params = SamplingParams(max_tokens=1)
    scheduled = [
        ScheduledRequest(f"r{i}", [1], context, list(range(context // 16 + 1)), True, params, 0)
        for i in range(batch)
    ]
    return SchedulerOutput(scheduled=scheduled, num_batched_tokens=batch)


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [("Mixtral-8x7B", 46.7, 12.9), ("Qwen3-30B-A3B", 30.5, 3.3), ("gpt-oss-20b", 20.9, 4.2)],
)
def test_moe_specs_hold_their_published_parameter_counts(name, total_b, active_b):
    model = MODELS[name]
    embeddings = model.num_params - model.num_layers * model.layer_params
    active = model.num_layers * model.active_layer_params + embeddings
    assert model.num_params / 1e9 == pytest.approx(total_b, rel=0.02)
    assert active / 1e9 == pytest.approx(active_b, rel=0.03)


def test_a_step_reads_the_experts_its_tokens_touch():
    model = MODELS["Qwen3-30B-A3B"]
    assert model.experts_touched(1) == pytest.approx(model.experts_per_token)
    assert model.experts_touched(4096) == pytest.approx(model.num_experts)
    one, many = model.step_weight_bytes(1), model.step_weight_bytes(256)
    assert one < many < model.weight_bytes * 1.0001
    # Decode at batch 1 reads about the active share; at 256 tokens nearly every expert.
    assert one < 0.2 * model.weight_bytes and many > 0.99 * model.weight_bytes
    gpu, params = GPUS["H100-80GB"], CostParams()
    moved = step_cost(_decode_step(1), model, gpu, params).bytes
    assert moved == pytest.approx(one + model.kv_bytes_per_token * (513 + 1), rel=1e-6)
    # A step of 64 decodes costs far less than 64 steps of one: they share the experts.
    t1 = step_cost(_decode_step(1), model, gpu, params).seconds
    t64 = step_cost(_decode_step(64), model, gpu, params).seconds
    assert t1 < t64 < 64 * t1 / 4
    dense = ModelSpec("dense-twin", 48, 2048, 32, 4, 128, 6144, 151936)
    assert dense.num_experts == 0 and dense.step_weight_bytes(64) == dense.weight_bytes


def test_a_quantized_checkpoints_spec_reads_its_experts_in_their_format(tmp_path):
    """config.json's quantization_config sets the bytes of every linear layer, experts
    included: Qwen3-30B-A3B-FP8's block-FP8 layout reads about half its bf16 bytes."""
    import json

    from engine.model.random_checkpoint import QUANT_CONFIGS, SHAPES

    shape = SHAPES["qwen3-30b-a3b-12l"]
    (tmp_path / "config.json").write_text(json.dumps(shape))
    bf16 = ModelSpec.from_hf_config(tmp_path, dtype_bytes=2)
    quantized = shape | {"quantization_config": QUANT_CONFIGS["fp8-block"]}
    (tmp_path / "config.json").write_text(json.dumps(quantized))
    fp8 = ModelSpec.from_hf_config(tmp_path, dtype_bytes=2)
    assert fp8.linear_bytes == pytest.approx(1.0, rel=1e-3) and not fp8.fp8_gemms
    for tokens in (1, 32, 4096):
        ratio = fp8.step_weight_bytes(tokens) / bf16.step_weight_bytes(tokens)
        assert 0.5 < ratio < 0.75, (tokens, ratio)  # the embeddings stay bf16


def test_the_tuner_takes_a_moe_model(tmp_path):
    from cluster.trace_file import save_trace

    save_trace(make_workload(120, 4.0, seed=5), tmp_path / "t.jsonl")
    argv = ["--trace", str(tmp_path / "t.jsonl"), "--slo", "ttft=2", "--slo", "itl=0.1"]
    argv += ["--model", "Qwen3-30B-A3B", "--gpu", "H100-80GB", "--trials", "2"]
    argv += ["--set", "max_num_seqs=64", "--set", "target_waiting=4", "--set", "max_replicas=2"]
    argv += ["--workers", "1", "--out", str(tmp_path / "out")]
    result = tune_main(argv)
    assert result["trials"] >= 1
    assert "Qwen3-30B-A3B on H100-80GB" in (tmp_path / "out" / "report.md").read_text()
