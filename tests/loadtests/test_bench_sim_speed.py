"""`bench_sim speed --json`: replica-hours per minute, against stepping in the same run."""

from __future__ import annotations

import json

from loadtests.bench_sim import cli as bench_sim


def test_speed_reports_replica_hours_per_minute_and_equal_results(capsys):
    bench_sim.main(["speed", "--hours", "0.01", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["replica_hours_per_minute"] > 0
    for workload in result["workloads"]:
        assert workload["equal"]
        assert workload["cohort"]["finished"] == workload["stepping"]["finished"] > 0
        assert workload["speedup"] > 0
