"""Rotary position embeddings (rotate-half layout, as in HF Llama), precomputed per position."""

from __future__ import annotations

import math

import torch


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"model: unsupported rope scaling type {kind!r}")


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None
    ) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        sin = emb.sin()
        half = head_dim // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("signed_sin", signed, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for the given positions, shaped [T, 1, D]."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.signed_sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half's negation folded into the sin table
    (negation is exact, so the result is bit-identical to HF's formula)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = x * cos
    out += swapped.mul_(signed_sin)  # not addcmul: a fused multiply-add would round differently
    return out
