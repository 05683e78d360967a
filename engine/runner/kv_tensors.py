"""The paged KV cache's tensors: per layer, K and V shaped [blocks, block_size, kv_heads,
head_dim] on the device, and the same layout in host memory for swap preemption."""

from __future__ import annotations

import torch

from engine.cpu.host_memory import zeros_on_huge_pages

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache holds for the `kv_cache_dtype` knob."""
    return torch.float8_e4m3fn if cache_dtype == "fp8_e4m3" else model_dtype


def device_caches(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, num_layers: int
) -> KVCaches:
    def zeros() -> torch.Tensor:
        if device.type == "cpu":
            return zeros_on_huge_pages(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    return [(zeros(), zeros()) for _ in range(num_layers)]


def host_caches(shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, pin: bool) -> KVCaches:
    """Swap space: pinned when the device cache is on a GPU (asynchronous copies)."""
    return [
        (
            torch.zeros(shape, dtype=dtype, pin_memory=pin),
            torch.zeros(shape, dtype=dtype, pin_memory=pin),
        )
        for _ in range(num_layers)
    ]
