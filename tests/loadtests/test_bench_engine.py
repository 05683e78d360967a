"""The engine benchmark runs end to end on the tiny model and reports every promised figure."""

from __future__ import annotations

import json

from loadtests import bench_engine
from loadtests.workload import load_workload


def test_workload_keeps_the_standard_lengths():
    items = load_workload("mixed-200", vocab_size=4096)
    assert len(items) == 200
    assert sum(len(it.prompt_token_ids) for it in items) == 53_754
    assert sum(it.max_tokens for it in items) == 27_135
    assert load_workload("mixed-200", 4096)[0] == items[0]  # same seed, same token ids


def test_bench_engine_json_has_the_promised_keys(tiny_model, capsys):
    result = bench_engine.main(
        ["--model", tiny_model, "--num-requests", "6", "--hf-batch-sizes", "2,4", "--json"]
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    for key in (
        "continuous_tok_s",
        "static_tok_s",
        "hf_static_tok_s",
        "speedup_vs_hf_static",
        "speedup_vs_static",
        "outside_forward_frac",
        "roofline_frac",
    ):
        assert result[key] > 0, key
    assert result["hf_static_best_batch_size"] in (2, 4)
    assert 0 < result["outside_forward_frac"] < 1
