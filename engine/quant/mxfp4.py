"""MXFP4 (the OCP microscaling format gpt-oss's experts ship in): blocks of 32 weights along
the input dimension, each an FP4 e2m1 code (two per byte, the even-indexed weight in the low
nibble) times the block's power of two (an e8m0 byte, biased by 127).

The engine serves such experts dequantized into the serving dtype at load: every MXFP4 value
is exact in bfloat16 and float32.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights per scale
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_SCALE_BIAS = 127


def _codebook() -> torch.Tensor:
    """The 16 e2m1 codes' values: sign bit 3, magnitude bits 0-2."""
    values = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    return torch.cat([values, -values])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 weights [..., G * 32] of `blocks` (uint8 [..., G, 16]) and `scales` (uint8
    [..., G])."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"model: MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    codebook = _codebook()
    codes = blocks.to(torch.uint8)
    low, high = codebook[(codes & 0x0F).long()], codebook[(codes >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - _SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1))
    return values.flatten(-2)
