"""The weight-only quantized GEMM kernel (engine/quant/dequant_gemm_kernel.py) under Triton's
interpreter against dequantize-then-GEMM: INT4 with act-order groups, FP8 blocks and FP8 rows
(Ampere's FP8 path), at row counts of decode and prefill tiles and sizes no tile divides."""

from __future__ import annotations

import os

import pytest
import torch

# NOTE: read when the kernels are defined, so before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.quant.fp8 import quantize_blocks, quantize_rows  # noqa: E402
from engine.quant.linear import (  # noqa: E402
    QuantizedLinear,
    fp8_block_triton_kernel,
    fp8_triton_kernel,
    int4_triton_kernel,
    reference_kernel,
)
from engine.quant.packing import pack_columns  # noqa: E402
from engine.quant.scheme import QuantScheme  # noqa: E402


def _layer(layout: str, n: int, k: int) -> QuantizedLinear:
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    scheme = QuantScheme("test", layout, group_size=32)
    layer = QuantizedLinear(k, n, False, scheme, torch.float32, -(-k // 32))
    if layout == "fp8":
        layer.weight, layer.weight_scale = quantize_rows(w)
    elif layout == "fp8_block":
        layer.weight, layer.weight_scale = quantize_blocks(w, (128, 128))
    else:
        layer.qweight = pack_columns(torch.randint(0, 16, (n, k), generator=gen).byte())
        layer.scales = torch.rand(n, -(-k // 32), generator=gen) * k**-0.5 / 4
        layer.zeros = torch.randint(0, 16, layer.zeros.shape, generator=gen).byte()
        groups = torch.arange(k, dtype=torch.int32) // 32
        layer.g_idx = groups[torch.randperm(k, generator=gen)]  # act order: scattered groups
    return layer


@pytest.mark.parametrize(
    ("layout", "kernel"),
    [
        ("int4", int4_triton_kernel),
        ("fp8_block", fp8_block_triton_kernel),
        ("fp8", fp8_triton_kernel),
    ],
)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 96, 160), (5, 200, 256), (40, 136, 392)])
def test_the_kernel_computes_what_dequantize_then_gemm_computes(layout, kernel, rows, n, k):
    layer = _layer(layout, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = kernel(layer, x)
    torch.testing.assert_close(got, reference_kernel(layer, x), atol=2e-5, rtol=1e-4)
