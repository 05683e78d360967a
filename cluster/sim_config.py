"""A simulated engine replica's configuration: the engine's own knobs (scheduler, cache,
speculation, LoRA) with the model and GPU it is priced for, and the batching policy."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from cluster.batching import MemoryAwareConfig, PolicyName, SlaConfig
from cluster.request_records import Slo
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core.lora_config import LoRAConfig
from engine.runner.cost_model import CostParams, GpuSpec, ModelSpec

# Simulated prompts carry no real tokens (all zeros would all "hit" a prefix cache), and a
# simulated GPU's KV cache is sized from its memory, not from a CPU byte budget.
SIM_CACHE = CacheConfig(kv_cache_bytes=None, enable_prefix_caching=False)
# The simulated models' context (Llama-2 and later: 4096 tokens or more).
SIM_SCHEDULER = SchedulerConfig(max_model_len=4096)


@dataclass(frozen=True)
class SimConfig:
    model: ModelSpec
    gpu: GpuSpec
    policy: PolicyName = "static"
    # The engine's knobs, as the engine defines them. scheduler.max_num_seqs is the static
    # value and the start value of dynamic policies; the cache is sized from the simulated
    # GPU's memory (gpu_memory_fraction) unless num_blocks says otherwise.
    scheduler: SchedulerConfig = SIM_SCHEDULER
    cache: CacheConfig = SIM_CACHE
    cost: CostParams = field(default_factory=CostParams)
    memory_aware: MemoryAwareConfig = field(default_factory=MemoryAwareConfig)
    sla: SlaConfig = field(default_factory=SlaConfig)
    slo: Slo = field(default_factory=Slo)
    kv_sample_every: int = 50  # steps between KV-usage samples in the time series
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # With speculation on: the chance a draft counts (while the drafts before it did).
    spec_acceptance: float = 0.7
    # LoRA adapters (requests name them: SimRequest.adapter): slots, and the rank priced.
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # Runs of steps that only decode the same batch are applied at once (equal results);
    # False: every step through EngineCore.step, the reference the runs are tested against.
    decode_cohort: bool = True

    @classmethod
    def for_engine(
        cls, engine: EngineConfig, model: ModelSpec, gpu: GpuSpec, **changes: Any
    ) -> SimConfig:
        """The simulated replica of an engine as deploy.yaml's `engine:` configures it: its
        scheduler and cache knobs, and tensor_parallel_size GPUs sharing the model."""
        scheduler = engine.scheduler
        if scheduler.max_model_len == "auto":
            scheduler = replace(scheduler, max_model_len=SIM_SCHEDULER.max_model_len)
        cache = replace(engine.cache, enable_prefix_caching=False)
        tp_model = model.with_tp(engine.tensor_parallel_size).quantized(engine.quantization)
        changes.setdefault("speculative", engine.speculative)
        changes.setdefault("lora", engine.lora)
        return cls(tp_model, gpu, scheduler=scheduler, cache=cache, **changes)

    def with_scheduler(self, **changes: Any) -> SimConfig:
        """A copy with some scheduler knobs changed (a sweep over max_num_seqs, ...)."""
        return replace(self, scheduler=replace(self.scheduler, **changes))

    def with_cache(self, **changes: Any) -> SimConfig:
        return replace(self, cache=replace(self.cache, **changes))
