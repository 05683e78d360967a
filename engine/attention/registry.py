"""Pick an attention backend by name; `auto` picks per device and dtype and says why."""

from __future__ import annotations

import logging
from typing import get_args

from engine.attention.base import AttentionBackend
from engine.core.config import AttentionBackendName
from engine.core.errors import InvalidParam

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)


def get_attention_backend(name: str, device: str, dtype: str) -> AttentionBackend:
    """`cpu`: the native kernels (CPU only); `torch`: the reference (any device and dtype);
    `auto`: `cpu` where the device is the CPU, the dtype float32 and the kernels build,
    else `torch`. Raises ValueError naming `attention_backend` for an impossible choice."""
    if name not in ATTENTION_BACKENDS:
        raise InvalidParam(
            "attention_backend",
            f"attention_backend: unknown backend {name!r}; choose one of {ATTENTION_BACKENDS}",
        )
    on_cpu = device == "cpu"
    if name == "cpu" and not on_cpu:
        raise InvalidParam(
            "attention_backend", f"attention_backend: 'cpu' runs on the CPU only, not on {device!r}"
        )
    if name == "cpu" or (name == "auto" and on_cpu and dtype == "float32"):
        # Imported here: the native kernels are built only when the device is the CPU.
        from engine.cpu.attention_backend import CpuAttentionBackend

        backend = CpuAttentionBackend()
        if name == "cpu" or backend.available:
            if name == "auto":
                logger.info("attention backend auto -> cpu (native kernels, %s float32)", device)
            return backend
        reason = "the native kernels did not build here"
    else:
        reason = f"no native kernels for {device} {dtype}"
    from engine.attention.torch_backend import TorchAttentionBackend

    if name == "auto":
        logger.info("attention backend auto -> torch (%s)", reason)
    return TorchAttentionBackend()
