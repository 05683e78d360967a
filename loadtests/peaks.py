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


def peak_native_gemm_flops(n: int = 2048, reps: int = 10) -> float | None:
    """Best FLOP/s of the engine's own CPU GEMM (`engine/cpu/csrc/gemm_fm.c`) on an n³
    product, or None where it does not run. On AMD AVX-512 hosts it is about twice torch's
    matmul (MKL keeps to AVX2 kernels there): then this, not torch, is the machine's peak."""
    from engine.cpu.decoder_ops import DecoderOps
    from engine.cpu.host_memory import keep_freed_memory_in_heap

    ops = DecoderOps()
    if ops.gemm_fm_max_tokens < n:
        return None
    keep_freed_memory_in_heap()  # as in the engine: no page faults on each call's buffers
    a, b = torch.randn(n, n), torch.randn(n, n)
    ops.mm_fm(a, b)
    return 2 * n**3 / min(timed(lambda: ops.mm_fm(a, b)) for _ in range(reps))


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
