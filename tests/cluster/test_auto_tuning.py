"""Self-tuning on the simulated fleet (the cluster simulator driving the real controller and
autoscaling rule): light traffic served by a fleet deployed for more converges to a cheaper
setting that meets the SLO, the setting is reverted once the traffic changes under it, and a
fleet already at its cheapest is left alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.cluster_sim import ClusterSimulator
from cluster.request_records import Slo, summarize_records
from cluster.tune.auto_tuner import AutoTuner, AutoTuning, tuned_fleet
from cluster.tune.report import Target
from cluster.tune.space import Setting, Space
from cluster.workload import make_workload
from engine.runner.cost_model import GPUS, MODELS, CostParams

REPLICA = (MODELS["Llama-2-7B"], GPUS["A100-80GB"], CostParams())
TARGET = Target(Slo(ttft_s=2.0, itl_s=0.1), attainment=0.9)
PHASE_S = 600.0
# Replicas take 4 minutes to start (a large model's cold start): a fleet kept at one replica
# cannot catch a jump in traffic in time, one kept at three can.
START = Setting(min_replicas=3, max_replicas=6, target_waiting=2.0, startup_delay_s=240.0)
SPACE = Space.of({"min_replicas": [1, 3], "max_replicas": [6], "startup_delay_s": [240.0]})
TUNING = AutoTuning(period_s=300.0, window_s=300.0, trials=2, min_requests=20)
LIGHT = make_workload(int(2 * PHASE_S), rate=2.0, seed=1)  # well within one replica
HEAVY = [  # then 15 requests/s, beyond one replica
    replace(r, request_id=f"heavy-{r.request_id}", arrival_s=PHASE_S + r.arrival_s)
    for r in make_workload(int(15 * PHASE_S), rate=15.0, seed=2)
]


def serving_at(series: list[tuple[float, int, int, int]], t: float) -> int:
    return [serving for at, serving, _, _ in series if at <= t][-1]


def test_a_fleet_converges_to_a_cheaper_setting_and_reverts_when_traffic_changes():
    tuner = AutoTuner(TUNING, SPACE, TARGET, REPLICA, START)
    result = ClusterSimulator(tuned_fleet(START, REPLICA, TARGET.slo)).run(
        LIGHT + HEAVY, retuner=tuner
    )
    applied, *rest = tuner.changes
    # On the first window of light traffic: one replica is enough, and a third of the cost.
    assert (applied.at_s, applied.kind, applied.setting.min_replicas) == (300.0, "apply", 1)
    assert applied.predicted is not None and TARGET.met(applied.predicted)
    assert "fewer replica-hours" in applied.reason
    # The controller and the rule ran it: the fleet went down to one replica, and the light
    # traffic still met the SLO.
    assert serving_at(result.replica_series, 299.0) == 3
    assert serving_at(result.replica_series, PHASE_S - 1) == 1
    light = {k: r for k, r in result.records.items() if r.arrival_s < PHASE_S}
    assert summarize_records(light, TARGET.slo, PHASE_S)["sla_attainment"] >= TARGET.attainment
    # Then the traffic changed under it: measured attainment fell below the predicted, and
    # the setting before came back (at the first period after the change).
    reverted = rest[0]
    assert (reverted.at_s, reverted.kind, reverted.setting) == (900.0, "revert", START), rest
    assert reverted.reason.startswith("measured ") and "predicted 1.000" in reverted.reason
    # The reverted setting stays off the table for its cooldown.
    cooldown_end = reverted.at_s + TUNING.cooldown_periods * TUNING.period_s
    assert not any(
        c.kind == "apply" and c.setting.min_replicas == 1 and c.at_s < cooldown_end
        for c in rest[1:]
    )
    assert serving_at(result.replica_series, 900.0 + START.startup_delay_s + 60) >= 3


def test_a_fleet_already_at_its_cheapest_is_left_alone():
    cheapest = replace(START, min_replicas=1)
    tuner = AutoTuner(TUNING, SPACE, TARGET, REPLICA, cheapest)
    ClusterSimulator(tuned_fleet(cheapest, REPLICA, TARGET.slo)).run(LIGHT, retuner=tuner)
    assert tuner.changes == []


def test_trace_rows_become_the_tuners_window_and_measurements():
    from cluster.tuning_loop import measured_records, window_requests

    rows = [
        {"request_id": "a", "arrival_unix": 100.0, "prompt_len": 5, "output_len": 4,
         "adapter": None, "rejected": False, "ttft_s": 0.2, "e2e_s": 0.8},
        {"request_id": "b", "arrival_unix": 160.0, "prompt_len": 7, "output_len": 9,
         "adapter": "sql", "rejected": True, "ttft_s": None, "e2e_s": 0.01},
    ]  # fmt: skip
    window = window_requests(rows, since=90.0)
    assert [(r.request_id, r.arrival_s, r.prompt_len, r.output_len) for r in window] == [
        ("a", 100.0, 5, 4),
        ("b", 160.0, 7, 9),
    ]
    assert window[1].adapter == "sql"
    (served, turned_away) = measured_records(rows, since=90.0)
    assert served.ttft == pytest.approx(0.2) and served.e2e == pytest.approx(0.8)
    assert served.num_output == 4
    assert turned_away.first_token_s is None  # a rejected request never met its SLO
    assert len(measured_records(rows, since=150.0)) == 1


def test_a_tuners_setting_is_written_as_applied_settings_and_read_back():
    from cluster.tuning_loop import as_record, as_setting
    from serve_app.config import AppArgs
    from serve_app.tuning_args import tuning_plan

    args = AppArgs.model_validate(
        {
            "model": "models/tiny",
            "batching": {"sla_eps_ms": 7.0},
            "autoscaling": {"min_replicas": 1, "max_replicas": 4, "downscale_waiting": 0.25},
            "tuning": {"auto": True, "replica_model": "Llama-2-7B", "replica_gpu": "A100-80GB"},
        }
    )
    plan = tuning_plan(args, "fingerprint")
    start = Setting(**plan["start"])
    chosen = replace(start, policy="combined", max_num_seqs=96, target_waiting=8.0)
    record = as_record(chosen, plan, version=3, now=50.0)
    assert (record.deployed, record.version, record.max_num_seqs) == ("fingerprint", 3, 96)
    assert record.batching["policy"] == "combined" and record.batching["sla_eps_ms"] == 7.0
    assert record.autoscaling["target_waiting"] == 8.0
    assert record.autoscaling["downscale_waiting"] == 0.25  # a knob it does not move: kept
    assert as_setting(record, start) == chosen
