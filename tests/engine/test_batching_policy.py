"""A policy object passed to LLMEngine moves the scheduler's limits between steps."""

from __future__ import annotations

from engine.core.config import SchedulerLimits
from engine.core.outputs import SchedulerStats
from engine.core.sampling_params import SamplingParams
from tests.conftest import build_engine


class OneAtATimeWhileQueued:
    """Caps the batch at 1 while anything waits, then lifts the cap: a toy policy."""

    def __init__(self) -> None:
        self.seen: list[SchedulerStats] = []

    def limits(self, stats: SchedulerStats) -> SchedulerLimits:
        self.seen.append(stats)
        return SchedulerLimits(1 if stats.num_waiting else 8, stats.max_num_batched_tokens)


def test_policy_limits_apply_from_the_next_step(tiny_model):
    policy = OneAtATimeWhileQueued()
    engine = build_engine(tiny_model, num_blocks=100, max_num_seqs=8)
    engine.policy = policy
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), f"prompt {i}", params)
    running = []
    while engine.has_unfinished_requests():
        engine.step()
        running.append(engine.stats().num_running)
    assert max(running) == 1
    assert policy.seen[0].num_waiting == 3 and policy.seen[0].kv_usage == 0.0
    assert len(policy.seen) == len(running)
