"""Pick an attention backend by name; `auto` picks per device and dtype. Every choice comes
with the reason for it, and a backend that cannot run the model's shapes is refused here, at
start, with an error naming the field."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import get_args

from engine.attention.base import AttentionBackend
from engine.core.config import AttentionBackendName
from engine.core.errors import InvalidParam

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)
HALF_DTYPES = ("float16", "bfloat16")
# Head sizes FlashInfer's prebuilt prefill kernels take; the triton kernel takes any up to 256.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
TRITON_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionShape:
    """What a backend must run: the engine's device and dtype, the model's head size and the
    cache's block size."""

    device: str  # torch device type: "cpu" or "cuda"
    dtype: str
    head_dim: int
    block_size: int
    kv_cache_dtype: str | None = None  # the knob's value; None: the model's dtype
    # The model's layers differ in what they attend to: attention sinks, or a sliding
    # window on some layers only (gpt-oss).
    per_layer: bool = False


def get_attention_backend(name: str, shape: AttentionShape) -> tuple[AttentionBackend, str]:
    """The backend `name` over `shape` and why it was chosen. `auto`: flashinfer where it is
    installed and runs the shape on CUDA, else triton on CUDA; the native `cpu` kernels for
    CPU float32 where they build; the `torch` reference otherwise. Raises InvalidParam naming
    `attention_backend` (or the field that rules a backend out) for an impossible choice."""
    if name not in ATTENTION_BACKENDS:
        raise InvalidParam(
            "attention_backend",
            f"attention_backend: unknown backend {name!r}; choose one of {ATTENTION_BACKENDS}",
        )
    if name == "auto":
        name, reason = _auto(shape)
    else:
        reason = "set in the configuration"
        problem = _cannot_run(name, shape)
        if problem is not None:
            field, why = problem
            raise InvalidParam(field, f"attention_backend {name!r} ({field}): {why}")
    backend = _build(name)
    logger.info("attention backend %s (%s)", name, reason)
    return backend, reason


def _auto(shape: AttentionShape) -> tuple[str, str]:
    if shape.device == "cuda":
        flashinfer = _cannot_run("flashinfer", shape)
        if flashinfer is None:
            return "flashinfer", "auto: flashinfer is installed and runs this shape"
        triton = _cannot_run("triton", shape)
        if triton is None:
            return "triton", f"auto: flashinfer ruled out ({flashinfer[1]})"
        return "torch", f"auto: flashinfer ruled out ({flashinfer[1]}); triton: {triton[1]}"
    cpu = _cannot_run("cpu", shape)
    if cpu is None:
        return "cpu", "auto: native kernels for CPU float32"
    return "torch", f"auto: no native kernels ({cpu[1]})"


def _cannot_run(name: str, shape: AttentionShape) -> tuple[str, str] | None:
    """(field, why) when backend `name` cannot run `shape` here; None when it can."""
    if name == "torch":
        return None
    if shape.kv_cache_dtype not in (None, "auto") and name in ("cpu", "flashinfer"):
        return "kv_cache_dtype", (
            f"reads {shape.dtype} caches only, not {shape.kv_cache_dtype} (triton and torch "
            "read FP8 caches)"
        )
    if name == "cpu":
        if shape.device != "cpu":
            return "device", f"runs on the CPU only, not on {shape.device!r}"
        if shape.dtype != "float32":
            return "dtype", f"runs float32 only, not {shape.dtype} (use torch)"
        from engine.cpu.attention_kernels import load_native_decode

        if load_native_decode() is None:
            return "attention_backend", "the native kernels did not build here (no C compiler)"
        return None
    if name == "triton":
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if shape.device != "cuda" and not interpreted:
            return "device", (
                f"runs on CUDA devices, not on {shape.device!r} (TRITON_INTERPRET=1 runs it "
                "on the CPU, slowly, for tests)"
            )
        if importlib.util.find_spec("triton") is None:
            return "attention_backend", "the triton package is not installed"
        if shape.head_dim > TRITON_MAX_HEAD_DIM:
            return "head_dim", f"head_dim {shape.head_dim} > {TRITON_MAX_HEAD_DIM}"
        return None
    if name == "flashinfer":
        if shape.device != "cuda":
            return "device", f"runs on CUDA devices, not on {shape.device!r}"
        if importlib.util.find_spec("flashinfer") is None:
            return "attention_backend", "flashinfer-python is not installed (the `gpu` extra)"
        if shape.dtype not in HALF_DTYPES:
            return "dtype", f"runs float16 or bfloat16, not {shape.dtype}"
        if shape.head_dim not in FLASHINFER_HEAD_DIMS:
            return "head_dim", f"head_dim {shape.head_dim} not in {FLASHINFER_HEAD_DIMS}"
        if shape.per_layer:
            return "model", (
                "plans one window for every layer and has no attention sinks (the model's "
                "layers differ: triton and torch run them)"
            )
        return None
    raise AssertionError(name)


def _build(name: str) -> AttentionBackend:
    # Imported here: each backend's dependencies load only when it is chosen.
    if name == "cpu":
        from engine.cpu.attention_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend()
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
