"""`bench_sim cpu` and `bench_sim paper` write one report: the simulator's tables and the
real-engine comparison below them, whichever ran last."""

from __future__ import annotations

import json

from loadtests.bench_sim.cli import main
from loadtests.bench_sim.report import CPU_HEADING, write_report


def test_cpu_comparison_lands_in_the_paper_report_and_survives_a_paper_rerun(tmp_path):
    cpu = main(
        ["cpu", "--model", "tiny", "--num-requests", "6", "--kv-mb", "1", "--out", str(tmp_path)]
    )
    assert [r["policy"] for r in cpu["rows"]][-3:] == ["memory_aware", "sla", "combined"]
    saved = json.loads((tmp_path / "cpu-tiny.json").read_text())
    assert saved["rows"] == cpu["rows"]
    report = (tmp_path / "report.md").read_text()
    assert report.startswith(CPU_HEADING) and report.count("| static |") == 4

    # The paper scenario's writer, fed one hand-built row (the simulation itself is tested
    # in tests/cluster).
    row = {
        "setting": "S",
        "policy": "static",
        "static_max_num_seqs": 8,
        "output_tok_s": 100.0,
        "capacity_rps": 1.0,
        "ttft_p99_s": 1.0,
        "itl_p50_s": 0.02,
        "preemptions": 0,
        "mean_batch_size": 8.0,
        "mean_kv_usage": 0.5,
    }
    gains = {
        "best_static_max_num_seqs": 8,
        "throughput_gain": 0.0,
        "best_static_capacity_max_num_seqs": 8,
        "capacity_gain": 0.0,
    }
    write_report({"rows": [row], "per_setting": {"S": gains}}, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Static vs dynamic batching (simulator)")
    assert report.count(CPU_HEADING) == 1
    assert report.index("| capacity gain |") < report.index(CPU_HEADING)
