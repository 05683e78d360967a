"""bench_sim disagg: goodput of colocated fleets against prefill/decode splits of the same
GPUs (one workload and SLO here; the benchmark runs two of each)."""

from __future__ import annotations

from loadtests.bench_sim.disagg import describe, run_disagg


def test_it_compares_every_fleet_on_the_same_gpus():
    result = run_disagg(gpus=3, quick=True, workloads=("chat",), slos=("itl-50ms",))
    (row,) = result["rows"]
    assert set(row["capacity_rps"]) == {"colocated-512", "colocated-2048", "1P+2D", "2P+1D"}
    assert all(rate > 0 for rate in row["capacity_rps"].values()), row
    best, colocated = row["best_split"], row["best_colocated"]
    assert row["capacity_rps"][best] == max(row["capacity_rps"][n] for n in ("1P+2D", "2P+1D"))
    ratio = row["capacity_rps"][best] / row["capacity_rps"][colocated]
    assert row["disaggregated_over_colocated"] == ratio
    assert row["transfer_ms_mean"] > result["transfer_latency_ms"]
    assert f"| chat | itl-50ms | {colocated} |" in describe(result)
