"""Quantized execution on CUDA: the FP8 (torch._scaled_mm), INT4 and FP8-block (Triton) GEMMs
against dequantize-then-GEMM at real layer sizes; every quantized format serving in bfloat16
with each GPU kernel passing the start-up self-check; an FP8 KV cache on the triton backend
against the torch backend (skipped without CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.quant.checkpoint_writer import FORMATS
from engine.quant.fp8 import quantize_blocks, quantize_rows
from engine.quant.linear import (
    QuantizedLinear,
    fp8_block_triton_kernel,
    fp8_scaled_mm_kernel,
    fp8_triton_kernel,
    int4_triton_kernel,
    quantized_layers,
    reference_kernel,
)
from engine.quant.packing import pack_columns
from engine.quant.scheme import QuantScheme
from tests.conftest import build_engine
from tests.engine.test_quantized_checkpoints import quant_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CUDA = torch.device("cuda")


def _relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def _layer(layout: str, n: int, k: int, **scheme) -> QuantizedLinear:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    scheme = QuantScheme("test", layout, **scheme)
    layer = QuantizedLinear(k, n, False, scheme, torch.bfloat16, k // 128)
    if layout == "fp8":
        q, scale = quantize_rows(w)
        layer.weight.copy_(q)
        layer.weight_scale.copy_(scale)
    elif layout == "fp8_block":
        q, scale = quantize_blocks(w, (128, 128))
        layer.weight.copy_(q)
        layer.weight_scale.copy_(scale)
    else:
        layer.qweight.copy_(pack_columns(torch.randint(0, 16, (n, k), generator=gen).byte()))
        layer.scales.uniform_(0.5 * k**-0.5 / 8, k**-0.5 / 8)
        layer.zeros.copy_(torch.randint(0, 16, layer.zeros.shape, generator=gen).byte())
        perm = torch.randperm(k, generator=gen)  # act-order groups: scattered columns
        groups = torch.arange(k, dtype=torch.int32) // 128
        layer.g_idx.copy_(torch.empty(k, dtype=torch.int32).scatter_(0, perm, groups))
    return layer.to(CUDA)


@pytest.mark.parametrize(
    ("layout", "kernel", "tolerance"),
    [
        ("fp8", fp8_scaled_mm_kernel, 0.06),  # activations quantized per token too
        ("fp8", fp8_triton_kernel, 0.01),  # weight-only: what Ampere GPUs run
        ("fp8_block", fp8_block_triton_kernel, 0.01),
        ("int4", int4_triton_kernel, 0.01),
    ],
)
@pytest.mark.parametrize("rows", [1, 16, 100, 333])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (14336, 4096), (4096, 14336)])
def test_cuda_gemm_against_dequantize_then_gemm(layout, kernel, tolerance, rows, n, k):
    layer = _layer(layout, n, k, group_size=128)
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)
    got = kernel(layer, x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert _relative_rms(got, reference_kernel(layer, x)) < tolerance


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "online-fp8"])
def test_every_format_serves_in_bfloat16_with_its_kernels_passing_the_self_check(fmt):
    model, _ = quant_model(fmt)
    engine = build_engine(model, device="cuda", dtype="bfloat16", max_num_seqs=8)
    verdicts = {c.part: c.result for c in engine.runner.self_check}
    assert set(verdicts.values()) == {"pass"}, engine.runner.self_check
    gemm = {"fp8-block": "fp8_block_gemm", "ct-fp8-block": "fp8_block_gemm"}.get(fmt)
    gemm = gemm or ("int4_gemm" if fmt.startswith(("awq", "gptq")) else "fp8_gemm")
    assert {gemm, "attention", "token_draw", "decode_graph"} <= set(verdicts)
    fast, reference = fast_and_reference_tokens(engine)
    if gemm != "fp8_gemm":  # weight-only kernels compute what the reference computes
        same = sum(a == b for a, b in zip(fast, reference, strict=True))
        assert same >= 4, (fast, reference)


def fast_and_reference_tokens(engine) -> tuple[list[list[int]], list[list[int]]]:
    """12 greedy tokens for each of 6 random prompts on the quantized layers' fast kernels,
    then on their reference (decode graphs off), from the same engine."""
    rng = random.Random(0)
    prompts = [[rng.randrange(4096) for _ in range(rng.randint(4, 60))] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fast = [r.token_ids for r in engine.generate(prompts, greedy)]
    for layer in quantized_layers(engine.runner.model):
        layer.kernel = reference_kernel
    engine.runner.graphs = None
    reference = [r.token_ids for r in engine.generate(prompts, greedy)]
    assert all(len(t) == 12 for t in fast)
    return fast, reference


def test_an_fp8_kv_cache_on_the_triton_backend_reads_what_torch_reads(tiny_model):
    rng = random.Random(1)
    prompts = [[rng.randrange(4096) for _ in range(rng.randint(4, 90))] for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("triton", "torch"):
        engine = build_engine(
            tiny_model, device="cuda", dtype="bfloat16", attention_backend=backend,
            kv_cache_dtype="fp8_e4m3",
        )  # fmt: skip
        assert engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        tokens[backend] = [r.token_ids for r in engine.generate(prompts, greedy)]
    same = sum(a == b for a, b in zip(tokens["triton"], tokens["torch"], strict=True))
    assert same >= 6, tokens
