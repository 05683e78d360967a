"""The per-layer scales of an FP8 KV cache, from the checkpoint where it ships them.

Checkpoints name them after their quantizer: `self_attn.k_scale` / `v_scale`
(compressed-tensors' kv_cache_scheme, vLLM's convention), `self_attn.k_proj.output_scale` /
`v_proj.output_scale` (older llm-compressor checkpoints) or one `self_attn.kv_scale` for both.
A layer without any gets 1.0, as vLLM does.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.checkpoint_reader import CheckpointReader

_NAMES = ("self_attn.{}_scale", "self_attn.{}_proj.output_scale", "self_attn.kv_scale")


def set_kv_scales(decoder: nn.Module, reader: CheckpointReader, device: torch.device) -> None:
    """Give every attention layer of `decoder` its FP8 cache scales (`kv_scales`), and say
    whether both came from the checkpoint (`kv_scales_from_checkpoint`)."""
    for i, layer in enumerate(decoder.layers):
        scales, found = [], 0
        for kind in ("k", "v"):
            names = [f"model.layers.{i}.{name.format(kind)}" for name in _NAMES]
            name = next((n for n in names if n in reader.entries), None)
            value = 1.0 if name is None else float(reader.read(name).float().reshape(-1)[0])
            if not value > 0:  # NaN too
                raise ValueError(f"model: KV cache scale {name} is {value}, not > 0")
            scales.append(torch.tensor(value, dtype=torch.float32, device=device))
            found += name is not None
        attention = layer.self_attn
        attention.kv_scales = (scales[0], scales[1])
        attention.kv_scales_from_checkpoint = found == 2


def measure_missing_kv_scales(decoder: nn.Module) -> None:
    """`calculate_kv_scales`: layers whose scales the checkpoint lacks take them from the next
    step with tokens (called once the engine is built: profiling and graph capture run
    dummy steps)."""
    for layer in decoder.layers:
        attention = layer.self_attn
        if attention.kv_scales is not None and not attention.kv_scales_from_checkpoint:
            attention.calculate_kv_scales = True
