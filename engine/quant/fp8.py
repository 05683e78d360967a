"""FP8 (e4m3) quantization arithmetic: per output row, per 2-D block, per token."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# Below this a row's scale would underflow; such a row is all zeros anyway.
_MIN_SCALE = 1e-12


def quantize_rows(
    w: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (fp8 [N, K], float32 scales [N]) with w ~ q * scale per row; `amax`
    gives each row's largest magnitude where w holds only some of the row's columns."""
    if amax is None:
        amax = w.abs().amax(dim=1).float()
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    # In place on one float32 copy: online quantization holds one weight at a time in float.
    scaled = w.to(torch.float32, copy=True).div_(scale[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (fp8 [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]) with
    w ~ q * scale of its block (the fine-grained FP8 format's arithmetic)."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    tiles = padded.reshape(rows, bn, cols, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(rows * bn, cols * bk)[:n, :k].contiguous(), scale


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Block scales [ceil(N/bn), ceil(K/bk)] -> one scale per element [N, K]."""
    n, k = shape
    wide = scale.repeat_interleave(block[0], dim=0)[:n]
    return wide.repeat_interleave(block[1], dim=1)[:, :k]


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (fp8 [M, K], float32 scales [M, 1]): dynamic per-token scales."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
