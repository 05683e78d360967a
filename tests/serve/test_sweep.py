"""The latency-throughput sweep against a real app: outputs written, numbers consistent."""

from __future__ import annotations

import json

import pytest

from loadtests.sweep import cli as sweep

pytestmark = pytest.mark.timeout(300)


def _run(tmp_path, serve_cluster, *levels: str) -> dict:
    return sweep.main(
        [
            "--url",
            serve_cluster.base_url,
            *levels,
            "--level-duration",
            "2",
            "--workload",
            "fixed",
            "--prompt-len",
            "24",
            "--output-len",
            "12",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )


def test_closed_loop_sweep_writes_every_output_with_consistent_numbers(tmp_path, serve_cluster):
    result = _run(tmp_path, serve_cluster, "--concurrency", "1,4")
    rows = result["variants"]["server"]["rows"]
    assert [(r["mode"], r["level"]) for r in rows] == [("concurrency", 1), ("concurrency", 4)]
    for r in rows:
        assert r["ok"] == r["requests"] > 0 and r["errors"] == 0
        # Tokens streamed (summed per chunk) equal the server's usage count and max_tokens.
        assert r["tokens_received"] == r["output_tokens"] == 12 * r["ok"]
        assert r["prompt_tokens"] == 24 * r["ok"]
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] <= r["e2e_p99_ms"]
        assert r["goodput_requests_per_s"] <= r["requests_per_s"]
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
    assert result["variants"]["server"]["knee"] in (0, 1)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["variants"]["server"]["rows"] == rows
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 3
    assert "concurrency 4" in (tmp_path / "report.md").read_text()
    for png in ("throughput.png", "latency_vs_throughput.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_open_loop_level_and_the_loopback_guard(tmp_path, serve_cluster):
    result = _run(tmp_path, serve_cluster, "--rate", "4")
    (row,) = result["variants"]["server"]["rows"]
    assert row["mode"] == "rate" and 2 <= row["requests"] <= 20
    assert row["tokens_received"] == row["output_tokens"] == 12 * row["ok"]
    with pytest.raises(SystemExit, match="not a loopback"):
        sweep.main(["--url", "http://10.1.2.3:8000", "--out", str(tmp_path)])


def test_overrides_reach_the_app_args():
    args = {"engine": {"max_num_seqs": 8}, "batching": {"policy": "sla"}}
    out = sweep.apply_overrides(args, sweep.parse_override("batching.policy=static"))
    out = sweep.apply_overrides(out, sweep.parse_override("engine.batching=static"))
    assert out == {
        "engine": {"max_num_seqs": 8, "batching": "static"},
        "batching": {"policy": "static"},
    }
    assert args["batching"]["policy"] == "sla"  # the input is not changed
