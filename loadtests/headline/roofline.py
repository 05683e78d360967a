"""A decode step's HBM roofline: the bytes it must read (the weights once, each row's KV
context once) at the device's bandwidth, published (the datasheet) and measured (a copy)."""

from __future__ import annotations

import torch

from engine.llm_engine import LLMEngine
from engine.runner.gpu_specs import GPUS
from engine.runner.model_specs import ModelSpec
from loadtests.peaks import timed


def served_spec(engine: LLMEngine) -> ModelSpec:
    """The cost model's shape of the engine's model as it serves it (its dtype, FP8 weights,
    FP8 KV): the one definition of its weight and KV bytes."""
    config = engine.config
    dtype_bytes = torch.tensor([], dtype=getattr(torch, config.dtype)).element_size()
    spec = ModelSpec.from_hf_config(config.model, dtype_bytes=dtype_bytes)
    return spec.quantized(config.quantization, config.cache.kv_cache_dtype)


def published_bandwidth(device: str) -> tuple[float | None, str]:
    """The datasheet HBM bandwidth (bytes/s) of this device and the table row it came from,
    or None where the table has no such device (the CPU)."""
    if not device.startswith("cuda"):
        return None, ""
    name = torch.cuda.get_device_name()
    if "PCIe" in name:  # the table holds SXM parts; a PCIe card's bandwidth is lower
        return None, ""
    memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    for key, spec in GPUS.items():
        model, _, size = key.partition("-")
        if model in name and (not size or abs(memory_gb - float(size[:-2])) < 10):
            return spec.mem_bw, key
    return None, ""


def copy_bandwidth(device: str, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Best bytes/s moved (read plus written) by copying a tensor far larger than the caches:
    the bandwidth a streaming kernel can reach on this device."""
    src = torch.ones(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / min(timed(lambda: dst.copy_(src), device) for _ in range(reps))


def decode_bytes(engine: LLMEngine, batch: int, context: float) -> float:
    """What one decode step of `batch` rows of about `context` tokens each reads at least:
    every weight once, but of the input embedding table only a few rows (a tied LM head
    reads it whole), and each row's keys and values."""
    spec = served_spec(engine)
    gathered = 0 if spec.tied_embeddings else spec.vocab_size * spec.hidden_size
    weights = spec.weight_bytes - gathered * spec.dtype_bytes
    return weights + batch * context * spec.kv_bytes_per_token
