"""The engine's knobs: each defined once here, with its default, its validation and its
description (pure Python: no torch, no ray).

Everything else derives from these records: deploy.yaml's `engine:` section
(serve_app.config.EngineArgs), the simulator's replica (cluster.sim_config.SimConfig) and
docs/configuration.md (generated from the descriptions by `python -m serve_app.config_docs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from engine.core.errors import InvalidParam
from engine.core.lora_config import LoRAConfig

SchedulingPolicy = Literal["fcfs", "priority", "sjf"]
BatchingMode = Literal["continuous", "static"]
PreemptionMode = Literal["recompute", "swap"]
Dtype = Literal["float32", "float16", "bfloat16"]
AttentionBackendName = Literal["auto", "cpu", "torch", "triton", "flashinfer"]
OnlineQuantization = Literal["fp8"]
KVCacheDtype = Literal["auto", "fp8_e4m3"]
GenerationConfigMode = Literal["auto", "none"]
SpeculativeMethod = Literal["ngram", "draft_model"]
MAX_SPECULATIVE_TOKENS = 16


def knob(default: Any, doc: str) -> Any:
    """A configuration field: its default and the description users read."""
    return field(default=default, metadata={"doc": doc})


def _check(ok: bool, param: str, rule: str, value: Any) -> None:
    if not ok:
        raise InvalidParam(param, f"{param} must be {rule}, got {value!r}")


def _one_of(param: str, value: Any, choices: Any) -> None:
    """`value` is one of the Literal type `choices`' values."""
    allowed = get_args(choices)
    _check(value in allowed, param, " or ".join(map(str, allowed)), value)


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is sized. The first rule set applies: `num_blocks`,
    `kv_cache_bytes`; else 1 GiB on CPU, and profiling with `gpu_memory_fraction` on a GPU."""

    block_size: int = knob(16, "Tokens per KV cache block.")
    num_blocks: int | None = knob(
        None, "KV cache blocks per replica, explicitly. Null: sized from a budget below."
    )
    kv_cache_bytes: int | None = knob(
        None,
        "KV cache byte budget per replica (its tensor-parallel ranks share it). Null: 1 GiB on "
        "CPU; on a GPU, sized by profiling (gpu_memory_fraction of each rank's GPU).",
    )
    gpu_memory_fraction: float = knob(
        0.9,
        "GPU: the share of the GPU's memory the engine may use; the KV cache gets it minus "
        "the weights and the peak activations of one profiled step of max_num_batched_tokens.",
    )
    enable_prefix_caching: bool = knob(
        True, "Reuse the KV of cached full blocks that share a request's prefix."
    )
    num_host_blocks: int | None = knob(
        None, "swap: host KV blocks per replica, explicitly. Null: from swap_space_bytes."
    )
    swap_space_bytes: int = knob(
        256 << 20, "swap: host memory for swapped-out KV blocks per replica."
    )
    kv_cache_dtype: KVCacheDtype = knob(
        "auto",
        "auto: the KV cache holds the model's dtype. fp8_e4m3: one byte per value (twice the "
        "blocks of a 16-bit cache in the same bytes), scaled per layer by the checkpoint's "
        "k_scale/v_scale where it ships them, else by 1.0 (or calculate_kv_scales). Runs on "
        "the triton and torch attention backends (auto picks them).",
    )
    calculate_kv_scales: bool = knob(
        False,
        "fp8_e4m3 without scales in the checkpoint: each layer's k and v scale is the "
        "largest magnitude of the first served step's keys and values over 448 (e4m3's "
        "largest), as vLLM's option does; false: 1.0.",
    )

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, "block_size", ">= 1", self.block_size)
        for name in ("num_blocks", "kv_cache_bytes", "num_host_blocks"):
            value = getattr(self, name)
            _check(value is None or value >= 1, name, ">= 1 or null", value)
        fraction = self.gpu_memory_fraction
        _check(0.0 < fraction <= 1.0, "gpu_memory_fraction", "in (0, 1]", fraction)
        _check(self.swap_space_bytes >= 0, "swap_space_bytes", ">= 0", self.swap_space_bytes)
        kv = self.kv_cache_dtype
        _one_of("kv_cache_dtype", kv, KVCacheDtype)


@dataclass(frozen=True)
class SchedulerLimits:
    """The two knobs a batching policy moves between steps."""

    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        tokens = self.max_num_batched_tokens
        _check(tokens >= 1, "max_num_batched_tokens", ">= 1", tokens)


@dataclass(frozen=True)
class SchedulerConfig:
    """Static scheduler settings; `limits()` gives the starting SchedulerLimits."""

    max_num_seqs: int = knob(
        128, "Most requests in one step's batch (the start value of dynamic batching policies)."
    )
    max_num_batched_tokens: int = knob(2048, "Most tokens (prefill chunks + decodes) in one step.")
    max_model_len: int | Literal["auto"] = knob(
        "auto",
        "Longest prompt + completion, in tokens, a request may have. auto: the model's "
        "max_position_embeddings (config.json).",
    )
    batching: BatchingMode = knob(
        "continuous",
        "continuous: iteration-level batching. static: admit a batch and run it until all of "
        "it finishes (the naive baseline, for A/B runs only).",
    )
    scheduling_policy: SchedulingPolicy = knob(
        "fcfs",
        "Admission and preemption order: fcfs (arrival), priority (the request's `priority`, "
        "lower first), sjf (prompt + max_tokens, shortest first).",
    )
    aging_s: float = knob(30.0, "A request waiting this long goes ahead of every other.")
    preemption_mode: PreemptionMode = knob(
        "recompute",
        "When KV blocks run out: recompute (drop a request's KV, recompute it later) or swap "
        "(copy it to host memory and back; recompute when the host pool is full).",
    )

    def __post_init__(self) -> None:
        self.limits()  # validates both
        length = self.max_model_len
        ok = length == "auto" or (isinstance(length, int) and length >= 2)
        _check(ok, "max_model_len", ">= 2 or auto", length)
        _one_of("batching", self.batching, BatchingMode)
        _one_of("scheduling_policy", self.scheduling_policy, SchedulingPolicy)
        _one_of("preemption_mode", self.preemption_mode, PreemptionMode)
        _check(self.aging_s > 0, "aging_s", "> 0", self.aging_s)

    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens, one step verifies them all."""

    enabled: bool = knob(False, "Draft tokens and verify them with the target model.")
    method: SpeculativeMethod = knob(
        "ngram",
        "ngram: drafts are the tokens that followed the latest earlier occurrence of the "
        "request's last n tokens (prompt and output; n from prompt_lookup_max down to "
        "prompt_lookup_min), as vLLM's ngram method. Output is unchanged, token for token, "
        "at any temperature: each drafted position draws the target with its own counter and "
        "a draft counts while it equals that draw. draft_model: a smaller checkpoint with the "
        "same tokenizer (`model`) drafts greedily, k single-token steps over its own paged KV "
        "cache in the same replica; output unchanged likewise.",
    )
    model: str | None = knob(
        None,
        "draft_model: the draft checkpoint (the target's tokenizer and vocabulary): a "
        "directory, Hub id or bucket URI, fetched as `model` is (docs/models.md).",
    )
    num_speculative_tokens: int = knob(
        4, f"Most tokens drafted per request per step (1 to {MAX_SPECULATIVE_TOKENS})."
    )
    prompt_lookup_min: int = knob(2, "ngram: the shortest suffix looked up (>= 1).")
    prompt_lookup_max: int = knob(4, "ngram: the longest suffix looked up (>= prompt_lookup_min).")
    adaptive: bool = knob(
        True,
        "Draft per request what pays: each request's drafts from its recent acceptance rate "
        "and the replica's measured step time against tokens per step, so speculation turns "
        "itself off where verifying costs more than it saves (large batches, low acceptance). "
        "false: always num_speculative_tokens.",
    )
    rejection_sampling: bool = knob(
        False,
        "draft_model: sampled requests' drafts are drawn from the draft's own distribution "
        "(their temperature and filters) and each counts with probability min(1, p/q), the "
        "first that does not replaced by a draw from the residual (standard speculative "
        "sampling): more drafts count at high temperature, and outputs follow the target's "
        "distribution without being token-identical to decoding without speculation. Greedy "
        "requests are unchanged either way.",
    )
    disable_by_batch_size: int | None = knob(
        None,
        "No drafts in a step whose running batch is larger than this. Null: only the "
        "adaptive rule decides.",
    )

    def __post_init__(self) -> None:
        _one_of("speculative.method", self.method, SpeculativeMethod)
        if self.method == "draft_model" and not self.model:
            raise InvalidParam("speculative.model", "speculative.model: draft_model needs one")
        if self.rejection_sampling and self.method != "draft_model":
            raise InvalidParam(
                "speculative.rejection_sampling",
                "speculative.rejection_sampling: only draft_model drafts have a distribution",
            )
        k, most = self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS
        ok = isinstance(k, int) and 1 <= k <= most
        _check(ok, "speculative.num_speculative_tokens", f"an integer in [1, {most}]", k)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        _check(low >= 1, "speculative.prompt_lookup_min", ">= 1", low)
        _check(high >= low, "speculative.prompt_lookup_max", ">= prompt_lookup_min", high)
        limit = self.disable_by_batch_size
        _check(limit is None or limit >= 1, "speculative.disable_by_batch_size", ">= 1", limit)


@dataclass(frozen=True)
class EmulateConfig:
    """`device: emulated`: the GPU whose step times an engine replica keeps, with no model."""

    model: str = knob(
        "Llama-3.1-8B",
        "device emulated: the model whose steps are priced, by name from the simulator's "
        "tables (Llama-2-7B, Llama-2-13B, Llama-3.1-8B, Llama-3-70B, Qwen2.5-7B). The served "
        "checkpoint (`model`) gives only the tokenizer.",
    )
    gpu: str = knob(
        "H100-80GB",
        "device emulated: the GPU, by name from the simulator's tables (A100-40GB, A100-80GB, "
        "H100-80GB, H200); its memory sizes the KV cache (gpu_memory_fraction after weights).",
    )
    calibration: str | None = knob(
        None,
        "device emulated: a `python -m loadtests.calibrate` JSON; its fitted model, device "
        "and constants price the steps instead of model and gpu.",
    )


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an LLMEngine over a checkpoint."""

    model: str = field(
        metadata={
            "doc": "The checkpoint (Llama, Mistral, Qwen2, Qwen3 and the mixtures of experts "
            "Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss: docs/models.md#architectures): a local HF "
            "checkpoint directory, a Hugging Face Hub id (org/name, fetched into the node's HF "
            "cache), or "
            "an object-store URI (s3://bucket/prefix/, gs://...; copied into a local cache). "
            "docs/models.md."
        }
    )
    revision: str | None = knob(None, "Hub ids: the branch, tag or commit to serve. Null: main.")
    object_store_endpoint_url: str | None = knob(
        None, "s3:// models: the endpoint of an S3-compatible store. Null: AWS's."
    )
    dtype: Dtype = knob("float32", "Weight and activation dtype.")
    device: str = knob(
        "cpu",
        "torch device of the engine: 'cpu' or 'cuda'; or 'emulated': no model, each step takes "
        "the time the cost model prices it at on the GPU of `emulate` and says a fixed text in "
        "the checkpoint tokenizer's ids (docs/emulated-replica.md).",
    )
    attention_backend: AttentionBackendName = knob(
        "auto",
        "Paged attention kernels: cpu (native, CPU float32), torch (the reference, any device), "
        "triton (our paged FlashAttention-style kernel, CUDA), flashinfer (FlashInfer's paged "
        "kernels, CUDA float16/bfloat16, the `gpu` extra), auto (CUDA: flashinfer where "
        "installed, else triton; CPU: cpu for float32, else torch). The choice and its reason "
        "are logged and exported as the dynabatch:attention_backend_info metric.",
    )
    quantization: OnlineQuantization | None = knob(
        None,
        "fp8: quantize a float16/bfloat16/float32 checkpoint's linear weights to FP8 (e4m3, "
        "one scale per output channel) while loading. Null: weights as the checkpoint has "
        "them; quantized checkpoints (compressed-tensors FP8, fp8 with weight_block_size, AWQ, "
        "GPTQ) are recognised from their quantization_config without this.",
    )
    seed: int = knob(0, "Seed of the engine's default sampling generator.")
    enforce_eager: bool = knob(
        False,
        "CUDA: run decode steps eagerly. Otherwise (with the triton backend) they replay CUDA "
        "graphs captured at start for padded batch sizes up to max_num_seqs.",
    )
    overlap_steps: bool = knob(
        True,
        "Keep the device busy while the host works: step N-1's tokens are detokenized and "
        "returned while the device runs step N, and where the scheduler can tell step N+1 "
        "before N's tokens are in, N+1 is launched before N is collected. Only a CUDA device "
        "runs steps asynchronously (on the CPU a step is done when launched); a step after "
        "one with grammar rows waits for its tokens (the grammar's next mask needs them).",
    )
    gpu_self_check: bool = knob(
        True,
        "Before the replica says ready, run each GPU kernel it will use (attention backend, "
        "quantized GEMMs, the draw kernel, a captured decode graph) once on a small random "
        "input and compare it with the torch reference; one that fails or disagrees is "
        "replaced by the reference for that part, logged, and exported as "
        "dynabatch:gpu_self_check_info. Kernels already on their reference (the CPU's) are "
        "not checked.",
    )
    num_threads: int | None = knob(
        None,
        "torch intra-op threads of the engine (and of its CPU kernels). Null: on the CPU, "
        "every core the process may run on (logged at start); on a GPU, torch's default.",
    )
    generation_config: GenerationConfigMode = knob(
        "auto",
        "auto: a request that leaves out temperature, top_p, top_k, min_p, "
        "repetition_penalty or max_tokens samples with the checkpoint's generation_config.json "
        "values for them (max_new_tokens for max_tokens), as vLLM does; shown in /v1/models. "
        "none: the API's own defaults.",
    )
    tensor_parallel_size: int = knob(
        1,
        "Devices one engine replica spans (one node): each holds 1/N of every layer's heads "
        "and MLP columns and of the vocabulary, in its own process (NCCL on CUDA, gloo on the "
        "CPU). The model's attention heads, KV heads and intermediate size must divide by it. "
        "On the CPU, num_threads counts per rank.",
    )
    expert_parallel: bool = knob(
        False,
        "Mixtures of experts under tensor_parallel_size N: each rank holds 1/N of the experts "
        "whole and runs them for every token (the ranks' outputs summed, as a row-parallel "
        "layer's), attention staying tensor-parallel; N must divide the experts. false: each "
        "rank holds 1/N of every expert's columns.",
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    emulate: EmulateConfig = field(default_factory=EmulateConfig)

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, Dtype)
        _one_of("attention_backend", self.attention_backend, AttentionBackendName)
        _one_of("generation_config", self.generation_config, GenerationConfigMode)
        _check(self.quantization in (None, "fp8"), "quantization", "fp8 or null", self.quantization)
        _check(
            self.num_threads is None or self.num_threads >= 1,
            "num_threads",
            ">= 1 or null",
            self.num_threads,
        )
        tp = self.tensor_parallel_size
        _check(tp >= 1, "tensor_parallel_size", ">= 1", tp)
