"""Pick an attention backend by name."""

from __future__ import annotations

from engine.attention.base import AttentionBackend


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "flash":
        if not device.startswith("cuda"):
            raise ValueError("attention_backend: 'flash' needs a CUDA device")
        raise ValueError("attention_backend: 'flash' is not built yet (its own issue); use 'torch'")
    raise ValueError(f"attention_backend: unknown backend {name!r}; choose 'torch' or 'flash'")
