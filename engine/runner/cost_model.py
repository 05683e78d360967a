"""CostModelRunner: prices a step from its SchedulerOutput alone (no torch), on a virtual clock.

Step time = overhead + max(compute time, memory time) + tensor-parallel communication, where
  compute = FLOPs / (peak FLOP/s x flops_efficiency x tp)
    FLOPs = 2 x non-embedding params x tokens + 2 x hidden x vocab x sampled rows
            (a mixture of experts: the params a token runs, its k experts of E)
            + 4 x layers x heads x head_dim x (context each token attends to)
  memory  = bytes / (HBM bandwidth x bw_efficiency x tp)
    bytes = weights once per step + KV read for every token's context + KV written
            (a mixture of experts: the experts the step's tokens touch, E·(1-(1-k/E)^tokens))
LoRA adapters add their shrink and expand FLOPs for their rows' tokens and each adapter's
weights read once per step.
Quantized replicas (ModelSpec.quantized): FP8 or INT4 linear weights are fewer bytes to stream;
FP8 GEMMs (weights and activations) run at the GPU's FP8 peak where it has one; an FP8 KV
cache (CacheConfig.kv_cache_dtype) halves the KV bytes of a token, so the same memory holds
twice the blocks.
  overhead = step_overhead_s + per_seq_overhead_s x requests + per_token_overhead_s x tokens
The roofline max() is the usual first-order model of a step (compute-bound prefill,
memory-bound decode). Efficiencies and overheads are fitted by `python -m loadtests.calibrate`
for this CPU; the GPU defaults are stated assumptions, documented in CostParams.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from engine.core.clock import VirtualClock
from engine.core.config import CacheConfig
from engine.core.outputs import ModelRunnerOutput, SchedulerOutput

# The specs' tables, also read from here.
from engine.runner.gpu_specs import GPUS as GPUS
from engine.runner.gpu_specs import GpuSpec
from engine.runner.model_specs import MODELS as MODELS
from engine.runner.model_specs import ModelSpec

GiB = 1 << 30


@dataclass(frozen=True)
class CostParams:
    """The fitted part of the model.

    GPU defaults are assumptions, not measurements: 60% of peak FLOP/s on large GEMMs and 80%
    of HBM bandwidth on weight/KV streaming are typical of well-tuned serving kernels; 4 ms of
    fixed per-step overhead and 15 us per request are typical of a Python scheduler (vLLM V0
    era, which the paper used). Calibrate for real hardware (loadtests/calibrate/cli.py).
    """

    flops_efficiency: float = 0.6
    bw_efficiency: float = 0.8
    step_overhead_s: float = 0.004
    per_seq_overhead_s: float = 15e-6
    per_token_overhead_s: float = 0.0


# Every step at the better of peak FLOP/s and bandwidth, no overhead: a step's roofline bound.
NO_LOSS = CostParams(
    flops_efficiency=1.0, bw_efficiency=1.0, step_overhead_s=0.0, per_seq_overhead_s=0.0
)


@dataclass(frozen=True)
class StepCost:
    seconds: float
    flops: float
    bytes: float


def step_cost(
    out: SchedulerOutput, model: ModelSpec, gpu: GpuSpec, params: CostParams, lora_rank: int = 0
) -> StepCost:
    """`lora_rank`: the rank of the LoRA adapters of rows that run one (each adapting every
    linear layer): their tokens' shrink and expand FLOPs, and each adapter's weights read."""
    return Pricer(model, gpu, params, lora_rank).step(out)


class Pricer:
    """Step costs for one model on one GPU: the model's constants worked out once (the
    simulator prices every step), the same arithmetic in the same order as ever."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, params: CostParams, lora_rank: int):
        self.model, self.gpu, self.params = model, gpu, params
        self.attn_flops_per_ctx = 4 * model.num_layers * (model.num_heads * model.head_dim)
        self.kv_tok = model.kv_bytes_per_token
        self.lora_params = model.num_layers * lora_rank * model.lora_params_per_rank
        self.linear_params = model.num_layers * model.active_layer_params
        self.sample_flops = 2.0 * model.hidden_size * model.vocab_size
        self.weight_bytes = model.weight_bytes
        self.tp = model.tp
        fp8 = model.fp8_gemms and gpu.fp8_flops
        self.linear_peak = gpu.fp8_flops if fp8 else gpu.peak_flops
        self.compute_share = params.flops_efficiency * self.tp
        self.bandwidth = gpu.mem_bw * params.bw_efficiency * self.tp

    def step(self, out: SchedulerOutput) -> StepCost:
        if not out.scheduled:
            return StepCost(self.params.step_overhead_s, 0.0, 0.0)
        sampled = 0
        attended = 0  # sum over scheduled tokens of the context each attends to
        context = 0  # sum over requests of their context, read once per request per step
        lora_tokens = 0
        lora_slots = set()
        # Integer sums (exact, and the cheapest Python loop: this runs per request per step).
        for s in out.scheduled:
            n, start = len(s.token_ids), s.num_computed_tokens
            attended += n * start + n * (n + 1) // 2
            context += start + n
            sampled += s.sample + s.num_drafts  # a row with drafts is sampled at each position
            if s.lora_slot >= 0:
                lora_tokens += n
                lora_slots.add(s.lora_slot)
        return StepCost(
            *self.cost(
                len(out.scheduled),
                out.num_batched_tokens,
                sampled,
                attended,
                context,
                lora_tokens,
                len(lora_slots),
            )
        )

    def cost(
        self,
        rows: int,
        tokens: int,
        sampled: int,
        attended: int,
        context: int,
        lora_tokens: int = 0,
        num_adapters: int = 0,
    ) -> tuple[float, float, float]:
        """Seconds, FLOPs and bytes of a step of `rows` requests computing `tokens`, of
        which `sampled` are sampled; `attended`: the sum over its tokens of the context
        each attends to; `context`: the sum over its rows of their context after the step;
        `lora_tokens` of its tokens run one of `num_adapters` adapters."""
        model, gpu, params, tp = self.model, self.gpu, self.params, self.tp
        linear_flops = 2.0 * (self.linear_params * tokens + self.lora_params * lora_tokens)
        other_flops = self.sample_flops * sampled + self.attn_flops_per_ctx * attended
        flops = linear_flops + other_flops
        weights = model.step_weight_bytes(tokens) if model.num_experts else self.weight_bytes
        nbytes = weights + context * self.kv_tok + tokens * self.kv_tok
        nbytes += num_adapters * self.lora_params * model.dtype_bytes
        compute = (linear_flops / self.linear_peak + other_flops / gpu.peak_flops) / (
            self.compute_share
        )
        memory = nbytes / self.bandwidth
        comm = 0.0
        if tp > 1 and gpu.interconnect_bw > 0:
            # Two ring all-reduces of the activations per layer.
            per_layer = 2 * tokens * model.hidden_size * model.dtype_bytes * 2 * (tp - 1) / tp
            comm = model.num_layers * per_layer / gpu.interconnect_bw
        overhead = (
            params.step_overhead_s
            + params.per_seq_overhead_s * rows
            + params.per_token_overhead_s * tokens
        )
        return overhead + max(compute, memory) + comm, flops, nbytes


def kv_blocks_for(
    model: ModelSpec, gpu: GpuSpec, block_size: int, gpu_memory_fraction: float
) -> int:
    """Blocks that fit in `gpu_memory_fraction` of the GPUs' memory after the weights."""
    free = gpu.mem_bytes * model.tp * gpu_memory_fraction - model.weight_bytes
    if free <= 0:
        raise ValueError(
            f"{model.name} ({model.weight_bytes / GiB:.1f} GiB) does not fit "
            f"in {model.tp} x {gpu.name}"
        )
    return max(1, math.floor(free / (block_size * model.kv_bytes_per_token)))


class CostModelRunner:
    """A ModelRunner that computes nothing: it advances a VirtualClock by each step's cost
    and "samples" a fixed token (workloads set lengths with max_tokens and ignore_eos)."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        clock: VirtualClock,
        params: CostParams | None = None,
        cache: CacheConfig | None = None,
        max_model_len: int | str = "auto",
        sampled_token_id: int = 1,
        spec_acceptance: float = 0.0,
        lora_rank: int = 0,
    ) -> None:
        """The KV cache holds `cache.num_blocks`, else what `cache.gpu_memory_fraction` of the
        simulated GPUs' memory holds after the weights (a CPU byte budget does not apply).
        `max_model_len` auto: what the cache holds (a simulated model has no config.json).
        `spec_acceptance`: with speculative decoding, each draft counts with this probability
        while the ones before it did (a seeded draw: runs repeat). `lora_rank`: see step_cost."""
        cache = cache or CacheConfig()
        model = model.quantized(kv_cache_dtype=cache.kv_cache_dtype)
        self.model, self.gpu, self.clock = model, gpu, clock
        self.params = params or CostParams()
        self._num_blocks = cache.num_blocks or kv_blocks_for(
            model, gpu, cache.block_size, cache.gpu_memory_fraction
        )
        capacity = self._num_blocks * cache.block_size
        self._max_model_len = capacity if max_model_len == "auto" else int(max_model_len)
        self.sampled_token_id = sampled_token_id
        self.busy_seconds = 0.0
        self.spec_acceptance = spec_acceptance
        self.lora_rank = lora_rank
        self.pricer = Pricer(model, gpu, self.params, lora_rank)
        self._acceptance_draws = random.Random(0)

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def max_model_len(self) -> int:
        return self._max_model_len

    def num_host_blocks(self) -> int:
        return 0  # the simulator preempts by recompute

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        cost = self.pricer.step(scheduler_output)
        self.clock.advance(cost.seconds)
        self.busy_seconds += cost.seconds
        token = self.sampled_token_id
        sampled, spec = {}, {}
        for s in scheduler_output.scheduled:
            if s.num_drafts:
                accepted = 0
                draw = self._acceptance_draws.random
                while accepted < s.num_drafts and draw() < self.spec_acceptance:
                    accepted += 1
                spec[s.request_id] = [token] * (accepted + 1)
            elif s.sample:
                sampled[s.request_id] = token
        return ModelRunnerOutput(sampled, spec_token_ids=spec)

    def run_step(self, rows: int, tokens: int, sampled: int, attended: int, context: int) -> float:
        """Price a step known by its sums alone (engine/core/sched/decode_cohort.py; see
        Pricer.cost), as `execute` prices it, and move the clock past it; returns the clock."""
        cost = self.pricer.cost(rows, tokens, sampled, attended, context)[0]
        self.clock.advance(cost)
        self.busy_seconds += cost
        return self.clock.now()
