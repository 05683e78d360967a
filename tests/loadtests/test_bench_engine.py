"""The engine benchmark runs end to end on the tiny model and reports every promised figure."""

from __future__ import annotations

import json
import os
import time

import pytest

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
        "device_idle_frac",
        "roofline_frac",
    ):
        assert result[key] > 0, key
    assert result["hf_static_best_batch_size"] in (2, 4)
    assert 0 < result["device_idle_frac"] < 1
    # The schedule priced at the machine's peaks is a lower bound of its wall time.
    assert 0 < result["step_bound_s"] < result["continuous_wall_s"]
    assert 0 < result["step_roofline_frac"] < 1
    assert result["peak_read_gb_s"] > 0
    if "peak_native_gemm_gflop_s" in result:  # our GEMM runs here: the best peak counts
        best = max(result["peak_native_gemm_gflop_s"], result["peak_gemm_gflop_s"])
        expected = result["roofline_frac"] * result["peak_gemm_gflop_s"] / best
        assert result["roofline_frac_best_gemm"] == pytest.approx(expected)
    assert result["speedup_vs_hf_static_bound"] > result["speedup_vs_hf_static"]
    for side in ("continuous", "static", "hf_static"):
        assert 0 <= result[f"{side}_steal_frac"] < 1, side
    assert result["speedup_vs_hf_static_steal_adjusted"] > 0
    assert result["speedup_vs_static_steal_adjusted"] > 0
    # Figures from different hosts differ (AVX-512 vs AVX2): the host is part of the result.
    assert result["host"]["cpus"] == os.cpu_count()
    assert result["host"]["simd"] in ("avx512f", "avx2", "avx", "sse4_2", "none", "unknown")


def test_shared_prefix_bench_reports_caching_on_and_off(tiny_model, capsys):
    result = bench_engine.main(
        [
            "--model",
            tiny_model,
            "--workload",
            "shared-prefix",
            "--num-requests",
            "12",
            "--prefix-len",
            "96",
            "--suffix-len",
            "8",
            "--prefix-output-len",
            "4",
            # A step computes at most 128 tokens, so the prefix is cached after the first
            # step (requests admitted in the same step as the first cannot hit it).
            "--max-num-batched-tokens",
            "128",
            "--json",
        ]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["prefill_tokens_off"] == 12 * 104
    # Two requests are admitted before the prefix is computed; the other ten reuse 96 tokens.
    assert result["prefill_tokens_on"] == 2 * 104 + 10 * 8
    for key in ("ttft_p50_ms_on", "ttft_p50_ms_off", "prefill_reduction", "hit_rate_on"):
        assert result[key] > 0, key
    assert result["outputs_identical"] is True


def test_cpu_accounting_sees_this_process_and_the_machine():
    from loadtests import cpu_accounting

    before, machine = cpu_accounting.snapshot(), cpu_accounting.machine_times()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn CPU in this process
        pass
    used = cpu_accounting.cpu_by_process(before)
    mine = cpu_accounting.snapshot()[os.getpid()][0]
    assert used[mine] >= 0.2, used
    after = cpu_accounting.machine_times()
    assert sum(after.values()) > sum(machine.values())
    assert 0.0 <= cpu_accounting.steal_fraction(machine, after) < 1.0
