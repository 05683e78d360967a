"""Copies between the host and the step's device that do not wait for the kernels queued
before them (on a GPU, through pinned host memory); on the CPU, the tensors themselves."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device) -> torch.Tensor:
    """A host list or tensor as a tensor on `device`: on a GPU through pinned memory without
    waiting for the kernels queued before it (a plain copy would wait for them)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy on the host, queued behind the kernels before it: read it once
    they are done. Pinned, so the copy does not block; the host allocator keeps the buffer
    until the copy is done."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
