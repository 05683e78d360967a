"""The MoE layer benchmark runs end to end on the CPU shape: each step size timed on the
MoE's path and on the dense MLP of the same active parameters, the experts a step touches
growing with its tokens."""

from __future__ import annotations

import json

from loadtests import bench_moe


def test_bench_moe_times_the_expert_path_against_the_dense_one(capsys):
    result = bench_moe.main(["--shape", "tiny", "--tokens", "1,64", "--repeat", "2", "--json"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    one, many = result["steps"]
    assert one["experts_touched"] == bench_moe.SHAPES["tiny"].top_k
    assert one["experts_touched"] < many["experts_touched"] <= bench_moe.SHAPES["tiny"].experts
    for row in (one, many):
        assert row["moe_grouped_ms"] > 0 and row["dense_ms"] > 0
        assert row["ratio"] == row["moe_grouped_ms"] / row["dense_ms"]
