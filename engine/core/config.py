"""Frozen configuration records of the engine core (pure Python: no torch, no ray)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority", "sjf"]
BatchingMode = Literal["continuous", "static"]
PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is sized.

    Exactly one sizing rule applies, in this order: `num_blocks` (explicit), `kv_cache_bytes`
    (a byte budget: the rule on CPU), `gpu_memory_fraction` (a fraction of device memory).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = 1 << 30
    gpu_memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    # Host-memory block pool for swap preemption: an explicit block count, else a byte budget.
    num_host_blocks: int | None = None
    swap_space_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )


@dataclass(frozen=True)
class SchedulerLimits:
    """The two knobs a batching policy moves between steps."""

    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Static scheduler settings; `limits()` gives the starting SchedulerLimits."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    batching: BatchingMode = "continuous"
    # Which waiting request is admitted first, and which running one is preempted first:
    # fcfs (arrival), priority (the request's priority, lower first), sjf (prompt + max_tokens,
    # shortest first). A request that has waited aging_s or more goes ahead of all others.
    scheduling_policy: SchedulingPolicy = "fcfs"
    aging_s: float = 30.0
    # recompute: a preempted request drops its KV and recomputes it. swap: its KV is copied
    # to the host pool and back (recompute when the host pool is full).
    preemption_mode: PreemptionMode = "recompute"

    def __post_init__(self) -> None:
        SchedulerLimits(self.max_num_seqs, self.max_num_batched_tokens)  # validates both
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.scheduling_policy not in ("fcfs", "priority", "sjf"):
            raise ValueError(
                f"scheduling_policy must be fcfs, priority or sjf, got {self.scheduling_policy!r}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}"
            )
        if self.aging_s <= 0:
            raise ValueError(f"aging_s must be > 0, got {self.aging_s}")

    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an LLMEngine over a local HF checkpoint directory."""

    model: str
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"
    attention_backend: Literal["torch", "flash"] = "torch"
    seed: int = 0
    # None keeps torch's default; benchmarks pin it to the core count.
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
