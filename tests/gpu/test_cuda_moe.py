"""Mixtures of experts on CUDA (skipped without it): the fused Triton kernels pass the
start-up self-check and equal the grouped torch path at Qwen3-30B-A3B's layer shape (128
experts of width 768, 8 per token) from one token to a prefill's 512, in bf16; each tiny MoE
family on CUDA gives the CPU engine's tokens (which the CPU suite checks against
transformers), gpt-oss's on the triton kernel's sinks and per-layer windows and its experts
on the grouped torch path; quantized experts (block FP8, AWQ) serve in bf16 on their layouts'
kernels, expert by expert."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.decoder_ops import DecoderOps
from engine.model.moe_config import MoESpec
from engine.model.moe_kernel import fused_experts
from engine.model.sparse_moe import SparseMoE, moe_layers
from tests.conftest import build_engine, tiny_model_dir
from tests.engine.test_oracle import random_prompts, run_mix
from tests.engine.test_quantized_moe import quant_moe_model
from tests.gpu.test_cuda_quant import fast_and_reference_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 32, 512])
def test_fused_experts_at_a_real_layer_shape(tokens):
    spec = MoESpec(128, 8, 768, True, False, (True,))
    moe = SparseMoE(2048, spec, None).to("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    for param in moe.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen, device="cuda") * 0.02)
    x = torch.randn(tokens, 2048, generator=gen, device="cuda").bfloat16()
    weights, experts = moe.route(x)
    got = fused_experts(x, moe.w13, moe.w2, weights, experts).float()
    want = moe.experts(x, weights, experts, DecoderOps(False)).float()
    error = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    assert error < 2e-2, float(error)


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "qwen2-moe", "gpt-oss"])
def test_each_family_on_cuda_gives_the_cpu_engines_tokens(family):
    model = tiny_model_dir(family)
    prompts = random_prompts(6, 8, max_len=40)
    sizes = {"max_num_seqs": 8, "max_num_batched_tokens": 32}
    arrivals = [0, 0, 0, 1, 2, 3, 4, 5]
    want = run_mix(build_engine(model, 4, 120, **sizes), prompts, [12] * 8, arrivals)
    cuda = build_engine(model, 4, 120, device="cuda", **sizes)
    checks = [(c.part, c.result) for c in cuda.runner.self_check]
    assert ("attention", "pass") in checks
    kernels = family != "gpt-oss"  # its biased, clamped experts: the grouped torch path
    assert [c for c in checks if c[0] == "moe"] == ([("moe", "pass")] if kernels else [])
    assert all(layer.kernel == kernels for layer in moe_layers(cuda.runner.model))
    if not kernels:
        assert cuda.runner.backend.name == "triton"  # (flashinfer has no sinks)
    assert run_mix(cuda, prompts, [12] * 8, arrivals) == want


@pytest.mark.parametrize(("arch", "fmt"), [("qwen3-moe", "fp8-block"), ("mixtral", "awq")])
def test_quantized_experts_serve_in_bfloat16_on_their_kernels(arch, fmt):
    model, _ = quant_moe_model(arch, fmt)
    engine = build_engine(model, device="cuda", dtype="bfloat16", max_num_seqs=8)
    verdicts = {c.part: c.result for c in engine.runner.self_check}
    assert set(verdicts.values()) == {"pass"}, engine.runner.self_check
    assert ("fp8_block_gemm" if fmt == "fp8-block" else "int4_gemm") in verdicts
    assert "moe" not in verdicts  # (the fused kernels take float experts only)
    fast, reference = fast_and_reference_tokens(engine)
    # Weight-only kernels compute what the reference computes, up to bf16 rounding.
    same = sum(a == b for a, b in zip(fast, reference, strict=True))
    assert same >= 4, (fast, reference)
