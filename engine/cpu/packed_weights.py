"""The W16 weight layout of the native GEMM (AVX-512 build): PackedWeight, and PackedLinear,
the Linear layer the decoder swaps in for it (`Decoder.pack_weights`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PackedWeight:
    """A [N, K] weight in the native GEMM's W16 layout: blocks of 16 rows, each stored
    [K][16] (zero rows past N), so the 16 rows' values at one k are one vector. A decode
    step's GEMV then streams each block once with no register transposes (which bound the
    row-major GEMV), and every tile reads W as one sequential stream.
    The products are bit-identical to the row-major ones."""

    BLOCK_ROWS = 16

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        blocks = -(-n // self.BLOCK_ROWS)
        with torch.no_grad():
            padded = weight.new_zeros(blocks * self.BLOCK_ROWS, k)
            padded[:n] = weight
            self.data = padded.view(blocks, self.BLOCK_ROWS, k).transpose(1, 2).contiguous()
        self.shape = (n, k)

    def unpacked(self) -> torch.Tensor:
        """The row-major [N, K] weight (a copy)."""
        n, k = self.shape
        return self.data.transpose(1, 2).reshape(-1, k)[:n].clone()


class PackedLinear(nn.Module):
    """A Linear layer whose weight is a `PackedWeight`, which the feature-major path's
    native GEMM reads (see `Decoder.pack_weights`). `forward`, the token-major path, which
    the hosts that pack never take, unpacks the weight on every call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = PackedWeight(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.unpacked(), self.bias)

    def unpacked(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = nn.Parameter(self.weight.unpacked(), requires_grad=False)
        linear.bias = self.bias
        return linear


def weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s weights, shared tensors once, packed ones (not in its state_dict)
    too."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            tensors[module.weight.data.data_ptr()] = module.weight.data
    return sum(t.numel() * t.element_size() for t in tensors.values())
