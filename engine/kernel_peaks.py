"""What the engine's own kernels do at best on this machine, measured on the spot: the
benchmarks' peaks beside torch's (engine internals stay behind this)."""

from __future__ import annotations

import time

import torch


def native_gemm_flops(n: int = 2048, reps: int = 10) -> float | None:
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
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        ops.mm_fm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
