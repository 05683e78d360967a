"""Swap preemption's copies between the device's KV cache and its host-memory pool."""

from __future__ import annotations

import torch

from engine.attention.base import stored

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) of every layer


def swap_blocks(
    device_caches: KVCaches,
    host_caches: KVCaches,
    out: list[tuple[int, int]],
    into: list[tuple[int, int]],
) -> None:
    """Copy blocks device -> host (`out`), then host -> device (`into`), every layer; pairs
    are (source block, destination block)."""
    device = device_caches[0][0].device
    for pairs, to_host in ((out, True), (into, False)):
        if not pairs:
            continue
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for (dev_k, dev_v), (host_k, host_v) in zip(device_caches, host_caches, strict=True):
            dev_k, dev_v, host_k, host_v = map(stored, (dev_k, dev_v, host_k, host_v))
            if to_host:
                host_k[dst] = dev_k[src.to(device)].to("cpu")
                host_v[dst] = dev_v[src.to(device)].to("cpu")
            else:
                dev_k[dst.to(device)] = host_k[src].to(device)
                dev_v[dst.to(device)] = host_v[src].to(device)
