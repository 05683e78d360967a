"""Lower bounds on a workload's time: its model FLOPs, and a recorded schedule priced at a
machine's peaks (the simulator's cost model with nothing lost)."""

from __future__ import annotations

import torch

from engine.core.outputs import SchedulerOutput
from engine.model.loader import DecoderSpec
from engine.runner.cost_model import NO_LOSS, GpuSpec, ModelSpec, step_cost
from loadtests.workload import WorkItem


def workload_flops(spec: DecoderSpec, items: list[WorkItem]) -> float:
    """Model FLOPs the workload needs at the least: weights for every token (a mixture of
    experts': the router and the k experts each token runs), the vocab projection once per
    output token, and causal attention over each token's context."""
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    q = spec.num_heads * spec.head_dim
    attention = h * (q + 2 * kv) + q * h
    dense_mlp = 3 * h * spec.intermediate_size
    moe = spec.moe
    weights_per_token = 0
    for layer in range(spec.num_layers):
        mlp = dense_mlp
        if moe is not None and moe.sparse_layers[layer]:
            mlp = h * moe.num_experts + moe.top_k * 3 * h * moe.expert_intermediate_size
            if moe.shared_expert_intermediate_size:  # and its one-output gate
                mlp += 3 * h * moe.shared_expert_intermediate_size + h
        weights_per_token += 2 * (attention + mlp)
    lm_head = 2 * h * spec.vocab_size
    attn_per_ctx = 4 * q * spec.num_layers  # QK^T and PV: 2 FLOPs per MAC, per context token
    total = 0.0
    for it in items:
        p, o = len(it.prompt_token_ids), it.max_tokens
        tokens = p + o - 1  # the last sampled token is never fed back
        total += tokens * weights_per_token + o * lm_head
        # Token at position i attends to i + 1 keys.
        total += attn_per_ctx * (tokens * (tokens + 1) / 2)
    return total


def schedule_bound_s(
    outputs: list[SchedulerOutput], model_dir: str, dtype: str, peaks: GpuSpec
) -> float:
    """The least time a recorded schedule could take on a machine with these peaks: each
    step priced at max(FLOPs / peak FLOP/s, bytes / read bandwidth), weights read once per
    step and every request's KV context once (the simulator's cost model, nothing lost)."""
    dtype_bytes = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    model = ModelSpec.from_hf_config(model_dir, dtype_bytes=dtype_bytes)
    return sum(step_cost(o, model, peaks, NO_LOSS).seconds for o in outputs)
