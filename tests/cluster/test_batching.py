"""The batching policies on hand-computed cases and under hypothesis."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.batching import (
    Bounds,
    CombinedPolicy,
    MemoryAwareConfig,
    MemoryAwarePolicy,
    SlaConfig,
    SlaPolicy,
    StaticPolicy,
    make_policy,
)
from engine.core.outputs import SchedulerStats


def stats(**kw) -> SchedulerStats:
    base = SchedulerStats(
        num_running=0,
        num_waiting=0,
        num_free_blocks=1000,
        num_used_blocks=0,
        num_total_blocks=1000,
        kv_usage=0.0,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        num_preemptions_total=0,
        num_steps_total=0,
    )
    return replace(base, **kw)


def test_static_keeps_its_value():
    assert StaticPolicy(48).limits(stats(num_running=5, num_waiting=9)).max_num_seqs == 48


def test_memory_aware_hand_computed():
    policy = MemoryAwarePolicy(MemoryAwareConfig(eta=0.95, bounds=Bounds(4, 512)), initial=32)
    # 20 running hold 400 blocks (20 each): 0.95 * 1000 / 20 = 47.5 -> 47
    s = stats(num_running=20, num_waiting=5, num_used_blocks=400)
    assert policy.limits(s).max_num_seqs == 47
    assert policy.limits(s).max_num_batched_tokens == 2048
    # Nothing waiting: keep the previous value, whatever the memory says.
    assert policy.limits(stats(num_running=20, num_used_blocks=900)).max_num_seqs == 47
    # Long sequences: 0.95 * 1000 / 100 = 9.5 -> 9, but never below the 30 running.
    s = stats(num_running=30, num_waiting=1, num_used_blocks=3000, num_total_blocks=1000)
    assert policy.limits(s).max_num_seqs == 30
    # Clamped to the upper bound.
    s = stats(num_running=2, num_waiting=1, num_used_blocks=2)
    assert policy.limits(s).max_num_seqs == 512


def decode_step(step: int, latency: float, batch: int, decoding: int | None = None):
    return stats(
        num_steps_total=step,
        last_step_decode_only=True,
        last_step_duration_s=latency,
        last_step_num_seqs=batch,
        num_running=batch,
        num_decoding=batch if decoding is None else decoding,
    )


def test_sla_moves_down_when_slow_and_up_when_fast():
    cfg = SlaConfig(
        target_s=0.05, eps_s=0.005, alpha=4, delta=4, window=1, max_step=0, bounds=Bounds(1, 64)
    )
    policy = SlaPolicy(cfg, initial=32)
    # Too slow at batch 32: b_high = max(32, 1 + 4) = 32, b_low = max(1 - 4, 1) = 1 -> b = 16,
    # but never below the 10 requests decoding.
    assert policy.limits(decode_step(1, 0.08, 32, decoding=10)).max_num_seqs == 16
    # Fast at batch 16: b_low = min(16, 32 - 4) = 16, b_high = min(32 + 4, 64) = 36 -> 26
    assert policy.limits(decode_step(2, 0.02, 16, decoding=10)).max_num_seqs == 26
    # In band at 26: [26 - 2, 26 + 2] -> 26
    assert policy.limits(decode_step(3, 0.05, 26, decoding=10)).max_num_seqs == 26


def test_sla_ignores_prefill_steps_and_repeated_stats():
    policy = SlaPolicy(SlaConfig(window=4), initial=20)
    mixed = replace(decode_step(1, 5.0, 20), last_step_decode_only=False)
    assert policy.limits(mixed).max_num_seqs == 20  # nothing observed yet: the start value
    s = decode_step(2, 0.05, 20)
    policy.limits(s)
    policy.limits(s)  # same step seen twice counts once
    assert list(policy._latency) == [0.05]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 300),  # running
            st.integers(0, 50),  # waiting
            st.integers(0, 5000),  # used blocks
            st.floats(0.001, 0.5),  # step latency
            st.booleans(),  # decode-only
        ),
        min_size=1,
        max_size=60,
    ),
    st.sampled_from(["memory_aware", "sla", "combined"]),
)
def test_dynamic_policies_stay_in_bounds_and_never_below_running(steps, name):
    bounds = Bounds(2, 128)
    policy = make_policy(
        name, 32, MemoryAwareConfig(bounds=bounds), SlaConfig(bounds=bounds, window=3)
    )
    for i, (running, waiting, used, latency, decode_only) in enumerate(steps):
        s = stats(
            num_running=running,
            num_waiting=waiting,
            num_used_blocks=min(used, 5000),
            num_total_blocks=5000,
            num_steps_total=i + 1,
            last_step_decode_only=decode_only,
            last_step_duration_s=latency,
            last_step_num_seqs=running,
            num_decoding=running // 2,
        )
        b = policy.limits(s).max_num_seqs
        assert b <= bounds.upper
        assert b >= min(bounds.lower, running) or b >= 1
        if name == "memory_aware":
            assert b >= min(running, bounds.upper)
        if name == "sla":
            assert b >= min(running // 2, bounds.upper)


def test_sla_converges_into_band_on_a_synthetic_latency_curve():
    """Latency 10 ms + 1 ms per sequence: the 50 +- 5 ms band holds batches 35 to 45."""
    cfg = SlaConfig(target_s=0.05, eps_s=0.005, alpha=4, delta=4, window=4, bounds=Bounds(1, 256))
    policy = SlaPolicy(cfg, initial=200)
    b = 200
    history = []
    for step in range(1, 400):
        latency = 0.010 + 0.001 * b
        b = policy.limits(decode_step(step, latency, b, decoding=0)).max_num_seqs
        history.append(b)
    tail = history[-50:]
    assert all(35 <= x <= 45 for x in tail), tail


def test_combined_is_the_minimum():
    memory = MemoryAwarePolicy(MemoryAwareConfig(bounds=Bounds(1, 500)), initial=100)
    sla = SlaPolicy(SlaConfig(bounds=Bounds(1, 500)), initial=40)
    s = stats(num_running=20, num_waiting=5, num_used_blocks=400)
    assert CombinedPolicy(memory, sla).limits(s).max_num_seqs == 40


def test_bad_configs_name_the_problem():
    with pytest.raises(ValueError, match="eta"):
        MemoryAwareConfig(eta=1.5)
    with pytest.raises(ValueError, match="bounds"):
        Bounds(10, 5)
    with pytest.raises(ValueError, match="policy"):
        make_policy("greedy", 8)  # type: ignore[arg-type]
