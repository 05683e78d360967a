"""Datasheet figures of the accelerators the cost model prices steps on (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one accelerator (dense, no sparsity)."""

    name: str
    peak_flops: float  # bf16 dense FLOP/s
    mem_bw: float  # HBM bytes/s
    mem_bytes: float
    interconnect_bw: float = 0.0  # per-GPU NVLink bytes/s (for TP all-reduces)
    fp8_flops: float = 0.0  # FP8 dense FLOP/s; 0: no FP8 tensor cores (weight-only FP8)


# Sources: NVIDIA A100 datasheet (2021: 312 TFLOP/s bf16 dense; 1,555 GB/s for 40 GB,
# 2,039 GB/s for 80 GB SXM; NVLink 600 GB/s), H100 SXM datasheet (989 TFLOP/s bf16 dense,
# 3.35 TB/s, NVLink 900 GB/s, 1,979 TFLOP/s FP8 dense), H200 SXM datasheet (989 TFLOP/s,
# 4.8 TB/s, 141 GB, 1,979 TFLOP/s FP8 dense). Ampere has no FP8 tensor cores.
GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("A100-40GB", 312e12, 1555e9, 40e9, 600e9),
        GpuSpec("A100-80GB", 312e12, 2039e9, 80e9, 600e9),
        GpuSpec("H100-80GB", 989e12, 3350e9, 80e9, 900e9, 1979e12),
        GpuSpec("H200", 989e12, 4800e9, 141e9, 900e9, 1979e12),
    )
}
