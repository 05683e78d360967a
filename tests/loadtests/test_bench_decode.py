"""The steady-decode benchmark runs end to end on the tiny model and reports its figures."""

from __future__ import annotations

import json

from loadtests import bench_decode


def test_bench_decode_reports_idle_fraction_tok_s_and_the_sampler(tiny_model, capsys):
    argv = ["--model", tiny_model, "--batch", "8", "--prompt-len", "24", "--steps", "6"]
    result = bench_decode.main([*argv, "--sampler-repeats", "3", "--json"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["outputs_identical"] is True  # greedy: overlap changes no token
    for name in ("sync", "overlap"):
        assert result[f"{name}_tok_s"] > 0
        assert 0 <= result[f"{name}_device_idle_frac"] < 1
        assert result[f"{name}_step_ms"] > 0
    assert result["overlap_vs_sync"] > 0
    assert result["sync_launched_ahead_frac"] == 0  # nothing is launched ahead without overlap
    assert result["sampler_ms_t1_top_p0.9"] > 0 and result["draw_sort_ms"] > 0


def test_seeded_sampling_is_the_same_with_and_without_overlap(tiny_model, capsys):
    argv = ["--model", tiny_model, "--batch", "6", "--prompt-len", "16", "--steps", "5"]
    argv += ["--temperature", "1.0", "--top-p", "0.9", "--frequency-penalty", "0.5"]
    result = bench_decode.main([*argv, "--logprobs", "2", "--json"])
    assert result["outputs_identical"] is True
    assert result["frequency_penalty"] == 0.5 and result["logprobs"] == 2
