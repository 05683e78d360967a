"""The simulator prices speculation: drafted rows cost their k + 1 tokens, accepted drafts
cut the steps a request needs, and the adaptive rule turns drafting off where it loses."""

from __future__ import annotations

from dataclasses import replace

from cluster.sim_config import SimConfig
from cluster.simulator import Simulator
from cluster.workload import make_workload
from engine.core.config import SpeculativeConfig
from engine.runner.cost_model import GPUS, MODELS

SPEC = SpeculativeConfig(enabled=True, num_speculative_tokens=4)


def run(rate: float, n: int, speculative: SpeculativeConfig | None, acceptance: float = 0.8):
    config = SimConfig(
        model=MODELS["Llama-2-7B"], gpu=GPUS["A100-80GB"], spec_acceptance=acceptance
    )
    if speculative is not None:
        config = replace(config, speculative=speculative)
    result = Simulator(config.with_scheduler(max_num_seqs=256)).run(
        make_workload(n, rate, "poisson", seed=3)
    )
    assert result.summary()["finished"] == n
    assert result.free_blocks_at_end == result.num_kv_blocks
    return result


def test_accepted_drafts_cut_inter_token_latency_at_low_load():
    plain = run(0.5, 20, None).summary()
    spec = run(0.5, 20, SPEC).summary()
    assert spec["itl_p50_s"] < 0.6 * plain["itl_p50_s"]


def test_drafts_that_never_count_cost_little_once_measured():
    plain = run(0.5, 20, None).summary()
    rejected = run(0.5, 20, SPEC, acceptance=0.0)
    always = run(0.5, 20, replace(SPEC, adaptive=False), acceptance=0.0)
    assert rejected.summary()["itl_p50_s"] < always.summary()["itl_p50_s"]
    assert rejected.summary()["itl_p50_s"] < 1.1 * plain["itl_p50_s"]
