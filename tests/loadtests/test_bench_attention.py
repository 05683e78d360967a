"""The attention benchmark runs every backend it can here and skips, with the reason, the
ones it cannot (on CPU: flashinfer and triton outside the interpreter)."""

from __future__ import annotations

import json

from loadtests import bench_attention


def test_bench_attention_reports_each_backend_against_its_roofline(tiny_model, capsys):
    argv = ["--model", tiny_model, "--device", "cpu", "--dtype", "float32"]
    argv += ["--backends", "torch,cpu,flashinfer", "--batches", "1,4", "--context", "40"]
    argv += ["--prefill-chunk", "48", "--reps", "2", "--json"]
    bench_attention.main(argv)
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    decode = [r for r in rows if r["kind"] == "decode"]
    assert {(r["backend"], r["batch"]) for r in decode} == {
        (b, n) for b in ("torch", "cpu") for n in (1, 4)
    }
    for r in decode:
        # Nothing runs faster than reading its bytes once.
        assert r["attention_us"] > 0 and r["attention_vs_roofline"] > 0.5
        assert r["step_ms"] > 0 and r["step_vs_roofline"] > 0.5
    prefill = [r for r in rows if r["kind"] == "prefill"]
    assert [r["backend"] for r in prefill] == ["torch", "cpu"]
    assert all(r["tokens_per_s"] > 0 and 0 < r["vs_matmul_peak"] < 2 for r in prefill)
    (skipped,) = [r for r in rows if r["kind"] == "skipped"]
    assert skipped["backend"] == "flashinfer" and "CUDA" in skipped["reason"]
