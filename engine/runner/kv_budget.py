"""How many bytes the KV cache gets. On a GPU, by profiling: one forward of the largest step
the scheduler can form measures the peak activation memory, and the cache takes
`gpu_memory_fraction` of the GPU's memory minus the weights and that peak."""

from __future__ import annotations

import logging

import torch

from engine.core.config import CacheConfig, SchedulerConfig
from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.runner.decode_graphs import measure_graph_bytes
from engine.runner.device_model import DeviceModel

logger = logging.getLogger(__name__)

# The CPU rule when kv_cache_bytes is null: host memory has no fraction to take.
CPU_KV_CACHE_BYTES = 1 << 30
_GIB = float(1 << 30)
# What the real decode-graph capture (over the full cache) holds beyond the one-block
# measurement of measure_graph_bytes: a few MiB on Hopper GPUs, its cause not yet pinned
# down (reports/notebook.md); without it the largest step ran a few MB past the fraction.
_GRAPH_CAPTURE_SLACK = 16 << 20


def num_cache_blocks(
    dm: DeviceModel,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    max_model_len: int,
    graph_rows: list[int],
) -> int:
    """The KV blocks of `dm`'s rank: cache.num_blocks, else as many as its budget holds.
    `graph_rows`: the decode graphs it will capture (engine/runner/decode_graphs.py)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = kv_cache_budget(dm, cache, scheduler, max_model_len, graph_rows)
    num_blocks = budget // dm.bytes_per_block()
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_bytes: a budget of {budget} bytes holds no KV block "
            f"({dm.bytes_per_block()} bytes each)"
        )
    return num_blocks


def kv_cache_budget(
    dm: DeviceModel,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    max_model_len: int,
    graph_rows: list[int],
) -> int:
    # A replica's byte budget is shared by its tensor-parallel ranks (a GPU's by its one rank).
    ranks = dm.world_size
    if cache.kv_cache_bytes is not None:
        return cache.kv_cache_bytes // ranks
    if dm.device.type != "cuda":
        return CPU_KV_CACHE_BYTES // ranks
    device = dm.device
    weights = torch.cuda.memory_allocated(device)
    peak = profile_step_bytes(dm, scheduler, max_model_len)
    graphs = 0
    if graph_rows:
        graphs = measure_graph_bytes(dm, scheduler.max_num_seqs, max_model_len, graph_rows)
        graphs += _GRAPH_CAPTURE_SLACK
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * cache.gpu_memory_fraction) - weights - peak - graphs
    logger.info(
        "KV cache budget %.2f GiB = %.2f x %.2f GiB - weights %.2f GiB - peak activations "
        "%.2f GiB (one profiled step of %d tokens) - decode graphs %.2f GiB",
        budget / _GIB,
        cache.gpu_memory_fraction,
        total / _GIB,
        weights / _GIB,
        peak / _GIB,
        scheduler.max_num_batched_tokens,
        graphs / _GIB,
    )
    # Other processes on the GPU may hold what the fraction counts on.
    return max(min(budget, free), 0)


def warn_if_short(cache_tokens: int, max_model_len: int) -> None:
    if cache_tokens < max_model_len:
        logger.warning(
            "the KV cache holds %d tokens, fewer than max_model_len (%d): longer requests "
            "are refused; raise the cache (kv_cache_bytes, gpu_memory_fraction, or "
            "kv_cache_dtype fp8_e4m3) or lower max_model_len",
            cache_tokens,
            max_model_len,
        )


def profile_step_bytes(dm: DeviceModel, scheduler: SchedulerConfig, max_model_len: int) -> int:
    """Peak device bytes a forward of the largest step takes beyond what is allocated now
    (and beyond its scratch cache)."""
    device = dm.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    logits = run_largest_step(dm, scheduler, max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del logits
    torch.cuda.empty_cache()
    return max(peak, 0)


def run_largest_step(
    dm: DeviceModel, scheduler: SchedulerConfig, max_model_len: int
) -> torch.Tensor:
    """Prefill `max_num_batched_tokens` tokens over as many requests as the step may hold
    (each sampled: the most logits rows), into a scratch cache freed on return."""
    order = largest_step(scheduler, dm.block_size, max_model_len)
    num_blocks = sum(len(r.block_ids) for r in order)
    spec = dm.spec
    shape = (num_blocks, dm.block_size, spec.num_kv_heads, spec.head_dim)
    k, v = (torch.empty(shape, dtype=dm.kv_dtype, device=dm.device) for _ in range(2))
    scratch = [(k, v)] * spec.num_layers  # every layer writes the same scratch blocks
    input_ids, positions, layout, logits_indices = dm.prepare_inputs(order)
    metadata = dm.backend.prepare(layout)
    with torch.inference_mode():
        return dm.model(input_ids, positions, scratch, dm.backend, metadata, logits_indices)


def largest_step(
    scheduler: SchedulerConfig, block_size: int, max_model_len: int
) -> list[ScheduledRequest]:
    tokens = scheduler.max_num_batched_tokens
    n = max(min(scheduler.max_num_seqs, tokens), -(-tokens // max_model_len))
    lengths = [tokens // n + (1 if i < tokens % n else 0) for i in range(n)]
    order, next_block = [], 0
    for i, length in enumerate(lengths):
        blocks = list(range(next_block, next_block + -(-length // block_size)))
        next_block += len(blocks)
        order.append(
            ScheduledRequest(f"profile-{i}", [0] * length, 0, blocks, True, SamplingParams(), 0)
        )
    return order
