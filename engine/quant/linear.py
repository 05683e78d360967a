"""A linear layer whose weight is held quantized, in one of three layouts:

- `fp8`: `weight` float8 e4m3 [N, K] and `weight_scale` float32 [N] (a per-tensor scale is
  stored once per row, so fused q/k/v with different scales stay exact);
- `fp8_block`: `weight` float8 e4m3 [N, K] and `weight_scale` float32 [N/bn, K/bk];
- `int4`: `qweight` int32 [N, K/8] (engine/quant/packing.py's sequential order along K),
  `scales` float32 [N, G], `zeros` uint8 [N, G] and `g_idx` int32 [K] (the group of each
  input column).

`forward` runs the layer's kernel (`kernel`): on CUDA the fast one of its layout (FP8:
`torch._scaled_mm` with dynamic per-token activation scales on GPUs with FP8 tensor cores,
compute capability 8.9 and up, else our Triton kernel with the FP8 weights dequantized in
registers; INT4 and FP8 blocks: our Triton kernel), else the reference (dequantize to the
activations' dtype, then the float GEMM). The GPU self-check (engine/runner/gpu_self_check.py)
sets a layout back to the reference where its fast kernel fails on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.fp8 import FP8, expand_blocks, quantize_tokens
from engine.quant.packing import unpack_columns
from engine.quant.scheme import QuantScheme

Kernel = Callable[["QuantizedLinear", torch.Tensor], torch.Tensor]


class QuantizedLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        dtype: torch.dtype,
        num_groups: int = 1,
    ) -> None:
        """`num_groups` (int4): the scale columns this layer holds (all of the checkpoint's
        for a row-parallel shard of an act-order GPTQ layer, else its own columns')."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.layout = scheme.layout
        self.block = scheme.block
        n, k = out_features, in_features
        if self.layout == "int4":
            self.register_buffer("qweight", torch.empty(n, k // 8, dtype=torch.int32))
            self.register_buffer("scales", torch.empty(n, num_groups, dtype=torch.float32))
            self.register_buffer("zeros", torch.empty(n, num_groups, dtype=torch.uint8))
            self.register_buffer("g_idx", torch.empty(k, dtype=torch.int32))
        else:
            self.register_buffer("weight", torch.empty(n, k, dtype=FP8))
            scale_shape = (n,)
            if self.layout == "fp8_block":
                scale_shape = (-(-n // self.block[0]), -(-k // self.block[1]))
            self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype)) if bias else None
        self.kernel: Kernel = reference_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = self.kernel(self, flat) if len(flat) else flat.new_empty(0, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] this layer computes with (float32 arithmetic, then
        rounded once to `dtype`)."""
        if self.layout == "int4":
            q = unpack_columns(self.qweight).to(torch.float32)
            g = self.g_idx.long()
            w = (q - self.zeros[:, g].to(torch.float32)) * self.scales[:, g]
        elif self.layout == "fp8_block":
            scale = expand_blocks(self.weight_scale, self.block, self.weight.shape)
            w = self.weight.to(torch.float32) * scale
        else:
            w = self.weight.to(torch.float32) * self.weight_scale[:, None]
        return w.to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, layout={self.layout}"


def reference_kernel(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """Any device: dequantize, then the float GEMM (correct, not fast)."""
    return F.linear(x, layer.dequantized(x.dtype))


def fp8_scaled_mm_kernel(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """CUDA (Ada, Hopper): FP8 x FP8 GEMM with per-token activation and per-row weight
    scales."""
    xq, x_scale = quantize_tokens(x)
    return torch._scaled_mm(
        xq,
        layer.weight.t(),
        scale_a=x_scale,
        scale_b=layer.weight_scale[None, :],
        out_dtype=x.dtype,
    )


def fp8_triton_kernel(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """CUDA without FP8 tensor cores (Ampere): weight-only FP8, dequantized in registers."""
    from engine.quant.dequant_gemm_kernel import fp8_rows_gemm

    return fp8_rows_gemm(x, layer.weight, layer.weight_scale)


def int4_triton_kernel(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    from engine.quant.dequant_gemm_kernel import int4_gemm

    return int4_gemm(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx)


def fp8_block_triton_kernel(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    from engine.quant.dequant_gemm_kernel import fp8_block_gemm

    return fp8_block_gemm(x, layer.weight, layer.weight_scale, layer.block)


# layout -> (the part's name in the self-check and metrics, its fast kernel on CUDA)
FAST_KERNELS: dict[str, tuple[str, Kernel]] = {
    "fp8": ("fp8_gemm", fp8_scaled_mm_kernel),
    "fp8_block": ("fp8_block_gemm", fp8_block_triton_kernel),
    "int4": ("int4_gemm", int4_triton_kernel),
}


def quantized_layers(model: nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def use_kernels(model: nn.Module, device: torch.device) -> None:
    """Every quantized layer of `model` on its layout's fast kernel on `device` (CUDA), else
    on the reference."""
    for layer in quantized_layers(model):
        layer.kernel = fast_kernel(layer.layout, device)


def fast_kernel(layout: str, device: torch.device) -> Kernel:
    if device.type != "cuda":
        return reference_kernel
    if layout == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        return fp8_triton_kernel  # no FP8 tensor cores for torch._scaled_mm
    return FAST_KERNELS[layout][1]


def set_layout_kernel(model: nn.Module, layout: str, kernel: Kernel) -> None:
    for layer in quantized_layers(model):
        if layer.layout == layout:
            layer.kernel = kernel
