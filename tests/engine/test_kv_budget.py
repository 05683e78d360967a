"""Sizing the KV cache: the largest step the profiling forward runs, the CPU default budget,
and `max_model_len: auto` (the GPU's profiled budget is checked in tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.runner.kv_budget import CPU_KV_CACHE_BYTES, largest_step, run_largest_step


@pytest.mark.parametrize(
    ("max_num_seqs", "tokens", "max_model_len", "block_size"),
    [(128, 2048, 2048, 16), (4, 2048, 256, 16), (1, 100, 4096, 7), (300, 50, 64, 4)],
)
def test_the_largest_step_fills_the_token_budget_within_every_limit(
    max_num_seqs, tokens, max_model_len, block_size
):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens)
    step = largest_step(config, block_size, max_model_len)
    assert sum(r.num_tokens for r in step) == tokens
    assert all(1 <= r.num_tokens <= max_model_len for r in step)
    assert all(r.sample and r.num_computed_tokens == 0 for r in step)
    blocks = [b for r in step for b in r.block_ids]
    assert sorted(blocks) == list(range(len(blocks)))  # each request its own scratch blocks
    assert all(len(r.block_ids) == -(-r.num_tokens // block_size) for r in step)


def test_the_profiled_step_runs_beside_the_cache_and_leaves_it_alone(tiny_model):
    from tests.conftest import build_engine

    engine = build_engine(tiny_model, 4, 64, max_num_seqs=8, max_num_batched_tokens=96)
    runner = engine.runner
    before = [k.clone() for k, _ in runner.kv_caches]
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96)
    logits = run_largest_step(runner.device_model(), scheduler, runner.max_model_len())
    assert logits.shape == (8, runner.spec.vocab_size)
    assert torch.isfinite(logits).all()
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, runner.kv_caches, strict=True))


def test_defaults_on_cpu_are_a_1_gib_cache_and_the_models_context(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model))
    runner = engine.runner
    assert runner.num_kv_blocks() * runner.bytes_per_block() <= CPU_KV_CACHE_BYTES
    assert runner.num_kv_blocks() == CPU_KV_CACHE_BYTES // runner.bytes_per_block()
    assert runner.max_model_len() == runner.spec.max_position_embeddings == 2048
    assert engine.scheduler.config.max_model_len == 2048
