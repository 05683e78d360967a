"""CostModelRunner: prices a step from its SchedulerOutput alone (no torch), on a virtual clock.

Step time = overhead + max(compute time, memory time) + tensor-parallel communication, where
  compute = FLOPs / (peak FLOP/s x flops_efficiency x tp)
    FLOPs = 2 x non-embedding params x tokens + 2 x hidden x vocab x sampled rows
            + 4 x layers x heads x head_dim x (context each token attends to)
  memory  = bytes / (HBM bandwidth x bw_efficiency x tp)
    bytes = weights once per step + KV read for every token's context + KV written
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

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from engine.core.clock import VirtualClock
from engine.core.config import CacheConfig
from engine.core.outputs import ModelRunnerOutput, SchedulerOutput

GiB = 1 << 30


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


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only model; `tp` GPUs share it by tensor parallelism."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tp: int = 1
    tied_embeddings: bool = False
    linear_bytes: float | None = None  # bytes per decoder-layer weight; None: dtype_bytes
    kv_dtype_bytes: int | None = None  # bytes per cached K or V value; None: dtype_bytes
    fp8_gemms: bool = False  # linear layers run FP8 x FP8 GEMMs (FP8 weights, dynamic FP8 acts)

    @property
    def layer_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size

    @property
    def num_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    @property
    def weight_bytes(self) -> float:
        linear = self.dtype_bytes if self.linear_bytes is None else self.linear_bytes
        embeddings = self.num_params - self.num_layers * self.layer_params
        return self.num_layers * self.layer_params * linear + embeddings * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        value = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * value

    def quantized(self, weights: str | None = None, kv_cache_dtype: str = "auto") -> ModelSpec:
        """This model as a replica serves it with `weights` ("fp8": FP8 weights and GEMMs,
        one float32 scale per output row; "int4": 4-bit weights with a float32 scale and a
        zero point per group of 128, as engine/quant/linear.py holds them) and an FP8 KV
        cache ("fp8_e4m3")."""
        spec = self
        if weights == "fp8":
            spec = replace(spec, linear_bytes=1.0, fp8_gemms=True, name=f"{spec.name}+fp8")
        elif weights == "int4":
            spec = replace(spec, linear_bytes=0.5 + 5 / 128, name=f"{spec.name}+int4")
        elif weights is not None:
            raise ValueError(f"weights must be fp8, int4 or None, got {weights!r}")
        if kv_cache_dtype == "fp8_e4m3":
            spec = replace(spec, kv_dtype_bytes=1, name=f"{spec.name}+kv-fp8")
        return spec

    def with_tp(self, tp: int) -> ModelSpec:
        return replace(self, name=f"{self.name.split('@')[0]}@tp{tp}", tp=tp)

    @classmethod
    def from_hf_config(cls, model_dir: str | Path, dtype_bytes: int = 4) -> ModelSpec:
        """The spec of a local HF checkpoint (config.json only; no weights are read)."""
        path = Path(model_dir)
        cfg = json.loads((path / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        return cls(
            name=path.name,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            dtype_bytes=dtype_bytes,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


# Shapes from each model's published config.json.
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000),
        ModelSpec("Llama-2-13B", 40, 5120, 40, 40, 128, 13824, 32000),
        ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
    )
}


@dataclass(frozen=True)
class CostParams:
    """The fitted part of the model.

    GPU defaults are assumptions, not measurements: 60% of peak FLOP/s on large GEMMs and 80%
    of HBM bandwidth on weight/KV streaming are typical of well-tuned serving kernels; 4 ms of
    fixed per-step overhead and 15 us per request are typical of a Python scheduler (vLLM V0
    era, which the paper used). Calibrate for real hardware (loadtests/calibrate.py).
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


def step_cost(out: SchedulerOutput, model: ModelSpec, gpu: GpuSpec, params: CostParams) -> StepCost:
    tokens = out.num_batched_tokens
    if not out.scheduled:
        return StepCost(params.step_overhead_s, 0.0, 0.0)
    q_dim = model.num_heads * model.head_dim
    attn_flops_per_ctx = 4 * model.num_layers * q_dim
    kv_tok = model.kv_bytes_per_token
    sampled = 0
    attended = 0  # sum over scheduled tokens of the context each attends to
    context = 0  # sum over requests of their context, read once per request per step
    # Integer sums (exact, and the cheapest Python loop: this runs per request per step).
    for s in out.scheduled:
        n, start = len(s.token_ids), s.num_computed_tokens
        attended += n * start + n * (n + 1) // 2
        context += start + n
        sampled += s.sample + s.num_drafts  # a row with drafts is sampled at each position
    kv_read = context * kv_tok
    linear_flops = 2.0 * model.num_layers * model.layer_params * tokens
    other_flops = (
        2.0 * model.hidden_size * model.vocab_size * sampled + attn_flops_per_ctx * attended
    )
    flops = linear_flops + other_flops
    nbytes = model.weight_bytes + kv_read + tokens * kv_tok
    tp = model.tp
    linear_peak = gpu.fp8_flops if model.fp8_gemms and gpu.fp8_flops else gpu.peak_flops
    compute = (linear_flops / linear_peak + other_flops / gpu.peak_flops) / (
        params.flops_efficiency * tp
    )
    memory = nbytes / (gpu.mem_bw * params.bw_efficiency * tp)
    comm = 0.0
    if tp > 1 and gpu.interconnect_bw > 0:
        # Two ring all-reduces of the activations per layer.
        per_layer = 2 * tokens * model.hidden_size * model.dtype_bytes * 2 * (tp - 1) / tp
        comm = model.num_layers * per_layer / gpu.interconnect_bw
    overhead = (
        params.step_overhead_s
        + params.per_seq_overhead_s * len(out.scheduled)
        + params.per_token_overhead_s * tokens
    )
    return StepCost(overhead + max(compute, memory) + comm, flops, nbytes)


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
    ) -> None:
        """The KV cache holds `cache.num_blocks`, else what `cache.gpu_memory_fraction` of the
        simulated GPUs' memory holds after the weights (a CPU byte budget does not apply).
        `max_model_len` auto: what the cache holds (a simulated model has no config.json).
        `spec_acceptance`: with speculative decoding, each draft counts with this probability
        while the ones before it did (a seeded draw: runs repeat)."""
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
        self._acceptance_draws = random.Random(0)

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def max_model_len(self) -> int:
        return self._max_model_len

    def num_host_blocks(self) -> int:
        return 0  # the simulator preempts by recompute

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        cost = step_cost(scheduler_output, self.model, self.gpu, self.params)
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
