"""The decode cohort equals stepping: the same finish and first-token times,
steps, preemptions, KV series and free blocks, on seeded scenarios of one replica and of
an autoscaled, controlled cluster."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.autoscale import AutoscaleConfig
from cluster.cluster_sim import ClusterSimConfig, ClusterSimulator
from cluster.sim_config import SimConfig
from cluster.simulator import Simulator
from cluster.workload import LengthDist, make_diurnal_workload, make_workload
from engine.runner.cost_model import GPUS, MODELS

BASE = SimConfig(MODELS["Llama-2-7B"], GPUS["A100-80GB"]).with_scheduler(max_num_seqs=128)


def outcome(result) -> dict:
    return {rid: (r.first_token_s, r.finish_s, r.num_output) for rid, r in result.records.items()}


def both(run):
    """The run stepping every step, and with the decode cohort."""
    return run(False), run(True)


SINGLE = {
    "light": (BASE, make_workload(150, 1.0, seed=3)),
    "busy": (BASE, make_workload(600, 12.0, seed=3)),
    # A small cache: preemptions, and waiting requests blocked by free blocks.
    "preempting": (BASE.with_cache(num_blocks=400), make_workload(400, 6.0, seed=4)),
    "static batches": (
        BASE.with_scheduler(batching="static", max_num_seqs=16),
        make_workload(200, 4.0, seed=5),
    ),
    # Short outputs against a short max_model_len: requests end on either limit.
    "model length": (
        BASE.with_scheduler(max_model_len=512),
        make_workload(
            300, 5.0, prompt=LengthDist("uniform", 100, 400), output=LengthDist("uniform", 4, 100)
        ),
    ),
}


@pytest.mark.parametrize("name", list(SINGLE))
def test_one_replica_equal_to_stepping(name):
    config, trace = SINGLE[name]
    stepped, fast = both(lambda s: Simulator(replace(config, decode_cohort=s)).run(trace))
    assert stepped.num_cohort_steps == 0 and fast.num_cohort_steps > 0
    assert outcome(fast) == outcome(stepped)
    assert fast.summary() | {"cohort_steps": 0} == stepped.summary()
    assert fast.kv_usage_series == stepped.kv_usage_series
    assert fast.free_blocks_at_end == stepped.free_blocks_at_end == fast.num_kv_blocks
    if name == "preempting":
        assert stepped.num_preemptions > 0


def test_time_limit_cuts_a_run_where_stepping_stops():
    trace = make_workload(400, 4.0, seed=6)
    stepped, fast = both(
        lambda s: Simulator(replace(BASE, decode_cohort=s)).run(trace, max_sim_s=40.0)
    )
    assert outcome(fast) == outcome(stepped)
    assert fast.duration_s == stepped.duration_s


@pytest.mark.parametrize("policy", ["static", "combined"])
def test_autoscaled_cluster_equal_to_stepping(policy):
    """Arrivals, autoscaling ticks and (combined) the controller's limits bound the runs."""
    trace = make_diurnal_workload(300, 1.0, 24.0, 300, seed=2)
    interval = None if policy == "static" else 1.0

    def run(cohort: bool):
        config = ClusterSimConfig(
            replace(BASE, policy=policy, decode_cohort=cohort),
            AutoscaleConfig(1, 4),
            startup_delay_s=20,
            controller_interval_s=interval,
        )
        return ClusterSimulator(config).run(trace)

    stepped, fast = both(run)
    assert outcome(fast) == outcome(stepped)
    assert fast.replica_series == stepped.replica_series
    assert fast.scale_events == stepped.scale_events and stepped.scale_events
    assert fast.summary() == stepped.summary()
