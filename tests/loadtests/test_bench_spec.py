"""The speculation benchmark runs end to end on the tiny model and reports what it promises."""

from __future__ import annotations

import json

from loadtests import bench_spec


def test_bench_spec_reports_speedups_by_batch_and_acceptance(capsys, tiny_model):
    argv = [
        "--model",
        tiny_model,
        "--batches",
        "1,3",
        "--acceptances",
        "1,0",
        "--draft",
        tiny_model,
    ]
    result = bench_spec.main([*argv, "--max-tokens", "12", "--ngram-batches", "2", "--json"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    for batch in ("1", "3"):
        rows = result["batches"][batch]
        assert set(rows) == {"1.0", "0.0"}
        assert rows["0.0"]["acceptance_measured"] in (None, 0.0)
        assert rows["1.0"]["acceptance_measured"] == 1.0
        assert all(r["tokens_per_s"] > 0 and r["speedup"] > 0 for r in rows.values())
    assert "speedup_batch1_acc08" not in result  # 0.8 was not asked for
    assert result["ngram"][0]["batch"] == 2
    (draft,) = result["draft_model"]  # the target as its own draft: every greedy draft counts
    assert draft["acceptance"] == 1.0 and draft["draft_tokens"] > 0
