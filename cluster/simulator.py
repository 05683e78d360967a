"""The simulator: the real Scheduler and KV manager, a CostModelRunner, a VirtualClock.

Nothing of the scheduler is re-implemented here: requests go through `Scheduler.add_request`
and every step through `EngineCore.step` (policy -> schedule -> execute -> update), exactly
as in the engine. Only the runner is priced instead of run.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.batching import MemoryAwareConfig, PolicyName, SlaConfig, make_policy
from cluster.request_records import RequestRecord, Slo, summarize_records
from cluster.workload import SimRequest
from engine.core.clock import VirtualClock
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core.engine_core import EngineCore
from engine.core.fixed_proposers import SimulatedDrafts
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.lora_config import LoRAConfig
from engine.core.lora_slots import LoRARequest, LoRASlots
from engine.core.policy import BatchingPolicy, ExternalLimits
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.speculator import Speculator
from engine.runner.cost_model import CostModelRunner, CostParams, GpuSpec, ModelSpec


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off for a simulation run. A run allocates millions of short-lived
    acyclic objects (refcounting frees them) next to a growing heap of records, and every
    full collection walks that heap."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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


@dataclass
class SimResult:
    config: SimConfig
    records: dict[str, RequestRecord]
    duration_s: float
    num_steps: int
    num_preemptions: int
    num_kv_blocks: int
    batch_size_sum: int
    kv_usage_series: list[tuple[float, float]]
    max_num_seqs_series: list[tuple[float, int]]
    free_blocks_at_end: int

    def summary(self) -> dict[str, float]:
        return summarize_records(self.records, self.config.slo, self.duration_s) | {
            "preemptions": self.num_preemptions,
            "mean_batch_size": self.batch_size_sum / max(self.num_steps, 1),
            "mean_kv_usage": (
                sum(u for _, u in self.kv_usage_series) / len(self.kv_usage_series)
                if self.kv_usage_series
                else 0.0
            ),
            "num_kv_blocks": self.num_kv_blocks,
            "steps": self.num_steps,
        }


class SimReplica:
    """One engine replica on its own virtual clock: the real Scheduler and EngineCore, with
    a CostModelRunner pricing each step. The single-replica Simulator drives one; the
    cluster simulator drives many on a shared timeline."""

    def __init__(
        self,
        config: SimConfig,
        records: dict[str, RequestRecord],
        start_s: float = 0.0,
        controlled: bool = False,
    ):
        """`controlled`: the batching policy runs outside (a ClusterControl sets `external`)."""
        c = self.config = config
        self.clock = VirtualClock(start_s)
        self.runner = CostModelRunner(
            c.model,
            c.gpu,
            self.clock,
            c.cost,
            c.cache,
            c.scheduler.max_model_len,
            spec_acceptance=c.spec_acceptance,
            lora_rank=c.lora.max_lora_rank if c.lora.enabled else 0,
        )
        kv = KVCacheManager(
            self.runner.num_kv_blocks(), c.cache.block_size, c.cache.enable_prefix_caching
        )
        sched_config = c.scheduler
        speculator = Speculator(c.speculative, SimulatedDrafts()) if c.speculative.enabled else None
        slots = LoRASlots(c.lora.max_loras) if c.lora.enabled else None
        self.scheduler = Scheduler(sched_config, kv, self.clock, speculator, slots)
        self._adapters: dict[str, LoRARequest] = {}
        # Static is the scheduler's own fixed limit: no policy call (and no stats) per step.
        policy: BatchingPolicy | None = (
            None
            if c.policy == "static"
            else make_policy(c.policy, c.scheduler.max_num_seqs, c.memory_aware, c.sla)
        )
        self.external: ExternalLimits | None = None
        if controlled:
            policy = self.external = ExternalLimits(sched_config.limits())
        self.core = EngineCore(self.scheduler, self.runner, self.clock, policy)
        self.records = records
        self.live: dict[str, Request] = {}
        self.kv_series: list[tuple[float, float]] = []
        self.seqs_series: list[tuple[float, int]] = []
        self.batch_sum = 0
        self.steps = 0
        self._prompts: dict[int, list[int]] = {}

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_requests(self) -> int:
        """Requests queued or running here (the router's load)."""
        return len(self.live)

    def add(self, req: SimRequest) -> None:
        """Hand a request over at its arrival time (an idle replica's clock catches up)."""
        if not self.busy and self.clock.now() < req.arrival_s:
            self.clock.advance(req.arrival_s - self.clock.now())
        self.records[req.request_id] = RequestRecord(req.arrival_s, req.prompt_len, req.output_len)
        prompt = self._prompts.get(req.prompt_len)
        if prompt is None:
            prompt = self._prompts[req.prompt_len] = [0] * req.prompt_len
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        lora = None
        if req.adapter is not None and self.config.lora.enabled:
            lora = self._adapters.get(req.adapter)
            if lora is None:
                lora = LoRARequest(req.adapter, len(self._adapters) + 1, "")
                self._adapters[req.adapter] = lora
        request = Request(req.request_id, prompt, params, (), req.arrival_s, lora=lora)
        self.scheduler.add_request(request)
        self.live[req.request_id] = request

    def step(self) -> None:
        result = self.core.step()
        self.steps += 1
        self.batch_sum += result.num_scheduled
        if result.num_scheduled == 0 and self.scheduler.stats().num_running == 0:
            raise RuntimeError("the scheduler made no progress with requests waiting")
        t = self.clock.now()
        for out in result.outputs:
            if out.finish_reason is not None:  # first-token time is on the Request
                request = self.live.pop(out.request_id)
                rec = self.records[out.request_id]
                rec.first_token_s = request.first_token_time
                rec.num_output = request.num_output_tokens
                rec.finish_s = t
        if self.steps % self.config.kv_sample_every == 1:
            stats = self.scheduler.stats()
            self.kv_series.append((t, stats.kv_usage))
            self.seqs_series.append((t, stats.max_num_seqs))


class Simulator:
    """One engine replica under a trace; `run` is deterministic for a given trace and config."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config

    def run(self, trace: list[SimRequest], max_sim_s: float = math.inf) -> SimResult:
        records: dict[str, RequestRecord] = {}
        replica = SimReplica(self.config, records)
        clock = replica.clock
        pending = deque(sorted(trace, key=lambda r: r.arrival_s))
        with gc_paused():
            while pending or replica.busy:
                now = clock.now()
                if now > max_sim_s:
                    break
                while pending and pending[0].arrival_s <= now:
                    replica.add(pending.popleft())
                if not replica.busy:
                    clock.advance(pending[0].arrival_s - now)
                    continue
                replica.step()
        stats = replica.scheduler.stats()
        return SimResult(
            config=self.config,
            records=records,
            duration_s=clock.now(),
            num_steps=replica.steps,
            num_preemptions=stats.num_preemptions_total,
            num_kv_blocks=replica.runner.num_kv_blocks(),
            batch_size_sum=replica.batch_sum,
            kv_usage_series=replica.kv_series,
            max_num_seqs_series=replica.seqs_series,
            free_blocks_at_end=stats.num_free_blocks,
        )


def capacity(
    config: SimConfig,
    make_trace,
    start: float = 0.5,
    target: float = 0.9,
    iters: int = 6,
) -> float:
    """The highest arrival rate (requests/s) at which >= `target` of requests meet the SLO:
    doubling from `start` to bracket it in [r, 2r], then `iters` bisections (resolution
    r / 2**iters). `make_trace(rate)` builds the trace for a rate."""
    sim = Simulator(config)

    def ok(rate: float) -> bool:
        return sim.run(make_trace(rate)).summary()["sla_attainment"] >= target

    lo = start
    while not ok(lo):
        lo /= 2
        if lo < 1e-3:
            return 0.0
    hi = lo * 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e5:
            return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
