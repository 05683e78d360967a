"""loadtests.serve_bench against the session's `llm` app: vLLM's report, exact token counts,
both endpoints, random and ShareGPT-format datasets, goodput under SLOs."""

from __future__ import annotations

import json

import pytest

from loadtests import serve_bench

pytestmark = pytest.mark.timeout(300)


def _bench(serve_cluster, *args: str) -> dict:
    return serve_bench.main(["--url", serve_cluster.base_url, "--seed", "3", *args])


def test_random_prompts_on_both_endpoints_make_exactly_their_tokens(
    serve_cluster, tmp_path, capsys
):
    out = tmp_path / "result.json"
    for endpoint in ("completions", "chat"):
        result = _bench(
            serve_cluster,
            *("--endpoint", endpoint, "--num-prompts", "6", "--max-concurrency", "3"),
            *("--random-input-len", "20", "--random-output-len", "9"),
            *("--result-file", str(out), "--goodput", "ttft:600000", "tpot:600000"),
        )
        assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
        assert result["total_output_tokens"] == 6 * 9
        assert result["output_lens"] == [9] * 6
        if endpoint == "completions":  # token ids, sent as they are
            assert result["input_lens"] == [20] * 6
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])
        for key in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < result[f"median_{key}_ms"] <= result[f"p99_{key}_ms"], key
        assert result["mean_e2el_ms"] > result["mean_ttft_ms"]
        assert json.loads(out.read_text())["total_output_tokens"] == 6 * 9
    printed = capsys.readouterr().out
    assert printed.count(" Serving Benchmark Result ") == 2
    assert "Output token throughput (tok/s):" in printed and "P99 ITL (ms):" in printed


def test_sharegpt_conversations_and_an_slo_nobody_meets(serve_cluster, tmp_path):
    turns = [
        [
            {"from": "human", "value": f"Tell me story number {i} about a cat"},
            {
                "from": "gpt",
                "value": "Once upon a time there was a cat who liked boxes. " * (i + 1),
            },
        ]
        for i in range(5)
    ]
    data = [{"id": str(i), "conversations": c} for i, c in enumerate(turns)]
    data.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    result = _bench(
        serve_cluster,
        *("--dataset", "sharegpt", "--dataset-path", str(path), "--num-prompts", "4"),
        *("--endpoint", "chat", "--goodput", "ttft:0.001"),
    )
    assert result["completed"] == 4, result["errors"]
    # Each reply's token count (from the server's /tokenize) is its request's max_tokens.
    assert len(set(result["output_lens"])) > 1 and min(result["output_lens"]) >= 4
    assert result["request_goodput"] == 0.0
