"""Pick an attention backend by name; `auto` picks per device and dtype and says why."""

from __future__ import annotations

import logging
import os
from typing import get_args

from engine.attention.base import AttentionBackend
from engine.core.config import AttentionBackendName
from engine.core.errors import InvalidParam

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)


def get_attention_backend(name: str, device: str, dtype: str) -> AttentionBackend:
    """`cpu`: the native kernels (CPU only); `torch`: the reference (any device and dtype);
    `triton`: the paged Triton kernel (CUDA; CPU under TRITON_INTERPRET=1); `auto`: `cpu`
    where the device is the CPU, the dtype float32 and the kernels build, else `torch`.
    Raises InvalidParam naming `attention_backend` for an impossible choice."""
    if name not in ATTENTION_BACKENDS:
        raise InvalidParam(
            "attention_backend",
            f"attention_backend: unknown backend {name!r}; choose one of {ATTENTION_BACKENDS}",
        )
    if name == "triton":
        return _triton(device)
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


def _triton(device: str) -> AttentionBackend:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device != "cuda" and not interpreted:
        raise InvalidParam(
            "attention_backend",
            f"attention_backend: 'triton' runs on CUDA devices, not on {device!r} "
            "(TRITON_INTERPRET=1 runs it on the CPU, slowly, for tests)",
        )
    try:
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    except ImportError as exc:
        raise InvalidParam(
            "attention_backend", f"attention_backend: 'triton' needs the triton package ({exc})"
        ) from None
