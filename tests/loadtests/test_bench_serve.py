"""The serving benchmark runs end to end on the tiny model's tokenizer with emulated H100
engines and two ingress replicas (own Ray instance, subprocess), streaming chat with trace
spans, one client, then the prompts in pairs: every request's TTFT splits into its stages,
and the pairs' differences have a median inside their interval."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtests.latency_pairs import median_interval
from tests.conftest import REPO


@pytest.mark.timeout(300)
@pytest.mark.own_cluster
def test_bench_serve_json_has_the_promised_keys(tiny_model):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtests.bench_serve",
            "--model",
            tiny_model,
            *("--workload", "random-96-24-6"),
            "--concurrency",
            "1",
            *("--paired", "1"),
            *("--emulate", "Llama-3.1-8B@H100-80GB", "--ingress-replicas", "2"),
            *("--chat", "--trace", "--json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    for key in ("http_tok_s", "inprocess_tok_s", "http_over_inprocess"):
        assert result[key] > 0, key
    for side in ("http", "inprocess"):
        assert result[side]["output_tokens"] == result["inprocess"]["output_tokens"]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            assert result[side][key] > 0, (side, key)
        assert 0 <= result[side]["steal_frac"] < 1
        assert result[side]["tok_s_steal_adjusted"] >= result[side]["tok_s"]
    # Direct ingress by default: the URLs are the ingress replicas' own ports, not the
    # proxy's, and the CPU accounting sees the engine and ingress replicas working for the
    # HTTP side.
    assert len(result["urls"]) == 2 and result["url"] == result["urls"][0]
    for url in result["urls"]:
        assert url.startswith("http://127.0.0.1:")
        assert 30000 <= int(url.split(":")[2].split("/")[0]) <= 31000, url
    cpu = result["http_cpu_ms_per_token"]
    assert cpu["ray::EngineServer"] > 0 and cpu["ray::OpenAIIngress"] > 0, cpu
    # Each request found its spans by its response's id; the stages follow one another
    # (spans and client share the host's clock) and add up to about the HTTP TTFT.
    stages = result["ttft_stages_ms"]
    assert stages.pop("matched") == 6 + 6, stages
    assert all(ms >= 0 for ms in stages.values()), stages
    assert sum(stages.values()) == pytest.approx(result["http"]["ttft_p50_ms"], rel=0.5)
    paired = result["paired"]
    assert paired["pairs"] == 6
    for key in ("ttft", "itl"):
        low, high = paired[f"{key}_added_ci95_ms"]
        assert low <= paired[f"{key}_added_ms"] <= high, paired
    assert paired["http_ttft_p50_ms"] > 0 and paired["inprocess_ttft_p50_ms"] > 0


def test_the_median_interval_widens_with_fewer_values_and_holds_the_median():
    values = [float(v) for v in range(100)]
    low, high = median_interval(values)
    # Sign test, n = 100: 39 values below the interval and 39 above it.
    assert (low, high) == (39.0, 60.0)
    assert median_interval(values[:5]) == [0.0, 4.0]  # too few for less than the range
    low, high = median_interval([3.0, -1.0, 7.0, 2.0, 5.0, 4.0, 0.0, 6.0, 1.0, 8.0, 9.0, 10.0])
    assert low <= 4.5 <= high and (low, high) != (-1.0, 10.0)
