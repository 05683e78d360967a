"""Rotary position embeddings (rotate-half layout, as in HF Llama), precomputed per position:
plain, linear, Llama 3 and YaRN scaling (as transformers computes each)."""

from __future__ import annotations

import math

import torch


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor cos and sin are scaled by (YaRN's; else 1)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    return _scaled(inv_freq, kind, scaling), 1.0


def _scaled(inv_freq: torch.Tensor, kind: str | None, scaling: dict) -> torch.Tensor:
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


def _yarn(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that turn many times within the original context
    keep their frequency, slow ones are interpolated by `factor`, a linear ramp between."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor, 1.0)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        """The dimension that turns `rotations` times over the original context."""
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention_factor)


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = _inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        sin = emb.sin() * attention_factor
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
