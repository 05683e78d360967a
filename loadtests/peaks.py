"""What this machine can do at best: peak GEMM FLOP/s and streaming read bandwidth, measured
on the spot (the hosts are shared and noisy, so every benchmark measures its own)."""

from __future__ import annotations

import time

import torch

from engine.runner.cost_model import GpuSpec


def timed(fn, device: str = "cpu") -> float:
    """Seconds `fn()` takes, waiting for the device's queued work on CUDA."""
    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if on_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def peak_gemm_flops(
    n: int | None = None, reps: int = 10, device: str = "cpu", dtype: str = "float32"
) -> float:
    """Best FLOP/s of a large matmul in the engine's dtype over several tries: the practical
    peak (best, not median, so that a noisy moment does not flatter a fraction of it)."""
    n = n or (8192 if device.startswith("cuda") else 2048)
    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    torch.matmul(a, b)
    return 2 * n**3 / min(timed(lambda: torch.matmul(a, b), device) for _ in range(reps))


def peak_read_bandwidth(nbytes: int = 256 << 20, reps: int = 5, device: str = "cpu") -> float:
    """Best bytes/s of summing a tensor far larger than the caches."""
    x = torch.ones(nbytes // 4, device=device)
    x.sum()
    return nbytes / min(timed(x.sum, device) for _ in range(reps))


def measure_device(kv_bytes: float, device: str = "cpu", dtype: str = "float32") -> GpuSpec:
    """This machine as a cost-model 'GPU spec': peak GEMM FLOP/s and read bandwidth."""
    return GpuSpec(
        f"this-{device}",
        peak_gemm_flops(device=device, dtype=dtype),
        peak_read_bandwidth(device=device),
        float(kv_bytes),
    )
