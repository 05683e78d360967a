"""The GPU self-check on the CPU, with broken kernels injected: each broken part (attention
backend, quantized GEMM, draw kernel, LoRA kernels, decode graph) falls back to its
reference, says why, is exported as dynabatch:gpu_self_check_info, and the replica goes on
serving token-exact."""

from __future__ import annotations

import os
import random

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

# NOTE: read when the triton kernels are defined, so before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from cluster.control import ControlDecision, ReplicaStats  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.quant.linear import int4_triton_kernel, set_layout_kernel  # noqa: E402
from engine.sampling import token_draw  # noqa: E402
from serve_app.observability.telemetry import render_engine_metrics  # noqa: E402
from tests.conftest import build_engine  # noqa: E402
from tests.engine.oracle import HFOracle  # noqa: E402
from tests.engine.replayed_graphs import replay_decodes  # noqa: E402
from tests.engine.test_oracle import check_against_oracle, random_prompts, run_mix  # noqa: E402
from tests.engine.test_quantized_checkpoints import quant_model  # noqa: E402


class WrongScaleAttention(TritonAttentionBackend):
    """The triton kernels with a wrong softmax scale: runs, and computes the wrong thing."""

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale, kv_scales=None, **layer):
        return super().forward(q, k, v, k_cache, v_cache, metadata, 2 * scale, kv_scales, **layer)


def _serves_like_the_oracle(engine, model: str, n: int = 6) -> None:
    rng = random.Random(1)
    prompts = random_prompts(1, n, max_len=30)
    max_tokens = [rng.randint(1, 10) for _ in prompts]
    tokens = run_mix(engine, prompts, max_tokens, [0] * len(prompts))
    check_against_oracle(HFOracle(model), prompts, max_tokens, tokens)


def test_the_check_runs_at_start_and_passes_working_kernels(tiny_model):
    engine = build_engine(tiny_model, attention_backend="triton")
    assert [(c.part, c.result) for c in engine.runner.self_check] == [("attention", "pass")]
    # On the CPU's own kernels there is nothing to check.
    assert build_engine(tiny_model).runner.self_check == []


def test_a_wrong_attention_kernel_falls_back_to_torch(tiny_model):
    engine = build_engine(tiny_model, attention_backend="triton")
    engine.runner.backend = WrongScaleAttention()
    (check,) = engine.runner.check_kernels()
    assert (check.part, check.result) == ("attention", "fallback")
    assert "relative RMS error" in check.reason
    assert engine.runner.backend.name == "torch"
    _serves_like_the_oracle(engine, tiny_model)


def test_a_gemm_kernel_that_raises_falls_back_to_the_reference():
    model, twin = quant_model("gptq-asym-actorder")
    engine = build_engine(model)

    def no_kernel_image(layer, x):
        raise RuntimeError("CUDA error: no kernel image is available for execution")

    set_layout_kernel(engine.runner.model, "int4", no_kernel_image)
    (check,) = engine.runner.check_kernels()
    assert (check.part, check.result) == ("int4_gemm", "fallback")
    assert "no kernel image" in check.reason
    _serves_like_the_oracle(engine, twin)


def test_a_working_int4_triton_kernel_passes():
    engine = build_engine(quant_model("awq")[0])
    set_layout_kernel(engine.runner.model, "int4", int4_triton_kernel)  # interpreted
    assert [(c.part, c.result) for c in engine.runner.check_kernels()] == [("int4_gemm", "pass")]


def test_a_wrong_draw_kernel_falls_back_to_the_sorted_draw(tiny_model):
    engine = build_engine(tiny_model)
    sampler = engine.runner.sampler
    sampler.draw_rows = lambda logits, params, u: logits.argmax(-1)  # ignores the filters
    (check,) = engine.runner.check_kernels()
    assert (check.part, check.result) == ("token_draw", "fallback")
    assert sampler.draw_rows is token_draw.draw_by_sort


@pytest.mark.parametrize("broken", [False, True])
def test_lora_kernels_are_checked_and_a_wrong_one_falls_back(tiny_model, monkeypatch, broken):
    from engine.lora import triton_kernels
    from tests.lora_adapters import lora_adapters

    engine = build_engine(tiny_model, lora={"adapters": lora_adapters(tiny_model)})
    lora = engine.runner.lora
    lora.kernel = True  # as on CUDA
    if broken:  # an expand that adds nothing
        monkeypatch.setattr(triton_kernels, "lora_expand", lambda *args: None)
    (check,) = engine.runner.check_kernels()
    assert (check.part, check.result) == ("lora", "fallback" if broken else "pass")
    assert lora.kernel is not broken


@pytest.mark.parametrize("broken", [False, True])
def test_a_decode_graph_that_replays_stale_outputs_falls_back_to_eager(tiny_model, broken):
    engine = build_engine(tiny_model, attention_backend="triton", enforce_eager=True)
    graphs = replay_decodes(engine, 4)
    if broken:
        for graph in graphs._graphs.values():
            graph.replay = lambda: None  # the outputs of capture time, not of the new inputs
    (check,) = engine.runner.check_graphs()
    assert check.part == "decode_graph"
    assert check.result == ("fallback" if broken else "pass")
    assert (engine.runner.graphs is None) == broken
    if broken:  # eager steps from now on (slow under the interpreter: two requests)
        _serves_like_the_oracle(engine, tiny_model, n=2)


def test_verdicts_are_exported_as_an_info_metric(tiny_model):
    engine = build_engine(tiny_model, attention_backend="triton")
    engine.runner.backend = WrongScaleAttention()
    checks = engine.runner.check_kernels()
    stats = ReplicaStats(
        replica_id="r1",
        scheduler=engine.stats(),
        num_streams=0,
        capacity=8,
        self_check_verdicts=tuple((c.part, c.result, c.reason) for c in checks),
    )
    limits = engine.scheduler.limits
    text = render_engine_metrics([("tiny", stats, ControlDecision(limits))]).decode()
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "dynabatch:gpu_self_check_info"
    ]
    assert [(s.labels["part"], s.labels["result"], s.value) for s in samples] == [
        ("attention", "fallback", 1.0)
    ]
    assert samples[0].labels["reason"].startswith("relative RMS error")
    assert samples[0].labels["replica"] == "r1"


def test_the_check_can_be_turned_off(tiny_model):
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig(model=tiny_model, attention_backend="triton", gpu_self_check=False)
    assert LLMEngine(config).runner.self_check == []


def test_tolerances_follow_the_outputs_dtype():
    """A bfloat16 kernel is held to bfloat16's rounding, a float32 one to float32's."""
    from engine.runner.gpu_self_check import _mismatch

    want = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    noisy = want * (1 + 0.01 * torch.randn(64, 128, generator=torch.Generator().manual_seed(1)))
    assert _mismatch(noisy.bfloat16(), want.bfloat16(), None, False) is None
    assert "relative RMS error" in _mismatch(noisy, want, None, False)
    tokens = torch.arange(8)
    assert _mismatch(tokens.clone(), tokens, None, True) is None
    assert _mismatch(torch.where(tokens == 3, 0, tokens), tokens, None, True) is None
    assert _mismatch(torch.zeros(8, dtype=torch.long), tokens, None, True) == "7 of 8 differ"
