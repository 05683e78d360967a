"""GET /metrics: Prometheus text that parses, engine metrics of every replica under vLLM's
names, and counters that move by exactly what the requests did."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.local_serve import NARROW_AUTH

pytestmark = pytest.mark.timeout(120)


def scrape(base_url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} from one parse of /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def total(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for k, v in samples.get(name, {}).items() if want <= set(k))


def settled_scrape(base_url: str, period_s: float = 1.5, timeout_s: float = 20.0) -> dict:
    """A scrape once the counters stop moving across a metrics push (earlier tests' last
    requests may still be on their way to the board)."""
    names = ("dynabatch:generation_tokens_total", "dynabatch:request_success_total")
    deadline = time.monotonic() + timeout_s
    last = scrape(base_url)
    while True:
        time.sleep(period_s)
        now = scrape(base_url)
        if all(total(now, name) == total(last, name) for name in names):
            return now
        assert time.monotonic() < deadline, "engine counters never settled"
        last = now


def test_engine_metrics_cover_every_replica_and_count_exactly(serve_cluster):
    base = serve_cluster.base_url
    before = settled_scrape(base)
    assert total(before, "dynabatch:num_engine_replicas") == 2
    replicas = {dict(k)["replica"] for k in before["dynabatch:num_requests_running"]}
    assert len(replicas) == 2
    for gauge in ("num_requests_waiting", "kv_cache_usage_perc", "max_num_seqs"):
        assert {dict(k)["replica"] for k in before[f"dynabatch:{gauge}"]} == replicas
    assert set(before["dynabatch:max_num_seqs"].values()) == {64.0}
    # Each replica says which attention kernels `auto` gave it (CPU float32: the native ones
    # where they build) and why.
    info = [dict(k) for k in before["dynabatch:attention_backend_info"]]
    assert {i["replica"] for i in info} == replicas
    assert {i["backend"] for i in info} <= {"cpu", "torch"}
    assert all(i["reason"].startswith("auto:") for i in info)
    # And what its KV cache holds (vLLM's cache_config_info).
    cache = [dict(k) for k in before["dynabatch:cache_config_info"]]
    assert {c["replica"] for c in cache} == replicas
    assert {(c["cache_dtype"], c["block_size"]) for c in cache} == {("float32", "16")}
    assert all(int(c["num_gpu_blocks"]) > 0 for c in cache)

    n, max_tokens = 6, 5
    usage = []
    for i in range(n):
        r = httpx.post(
            f"{base}/v1/completions",
            json={
                "model": "tiny",
                "prompt": f"count me {i}",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            },
            timeout=60,
        )
        assert r.status_code == 200
        usage.append(r.json()["usage"])

    def moved() -> dict | None:
        now = scrape(base)
        done = total(now, "dynabatch:request_success_total", finished_reason="length")
        return (
            now
            if done - total(before, "dynabatch:request_success_total", finished_reason="length")
            >= n
            else None
        )

    deadline = time.monotonic() + 10
    after = moved()
    while after is None and time.monotonic() < deadline:
        time.sleep(0.25)
        after = moved()
    assert after is not None, "engine counters did not move within 10 s"

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    assert delta("dynabatch:generation_tokens_total") == n * max_tokens
    assert delta("dynabatch:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("dynabatch:time_to_first_token_seconds_count") == n
    assert delta("dynabatch:e2e_request_latency_seconds_count") == n
    assert delta("dynabatch:request_queue_time_seconds_count") == n
    assert delta("dynabatch:inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert delta("dynabatch:iteration_batch_size_count") >= max_tokens
    # Histogram buckets are cumulative and end at the count.
    ttft = after["dynabatch:time_to_first_token_seconds_bucket"]
    for replica in replicas:
        rows = sorted(
            (float(dict(k)["le"]), v) for k, v in ttft.items() if dict(k)["replica"] == replica
        )
        assert [v for _, v in rows] == sorted(v for _, v in rows)
        count = total(after, "dynabatch:time_to_first_token_seconds_count", replica=replica)
        assert rows[-1] == (float("inf"), count)


def test_speculation_counters_move_when_a_prompt_repeats_itself(serve_cluster):
    """The `llm` app speculates (ngram): a prompt that repeats a phrase gets drafts, and
    /metrics counts them under vLLM's spec_decode names; the output is the same as the
    narrow app's, which does not speculate."""
    base = serve_cluster.base_url
    before = settled_scrape(base)
    body = {
        "model": "tiny",
        "prompt": "the cat sat on the mat. " * 12,
        "max_tokens": 40,
        "temperature": 0,
    }
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    plain = httpx.post(
        f"{serve_cluster.v1('narrow')}/completions", json=body, headers=NARROW_AUTH, timeout=60
    )
    assert plain.status_code == 200
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    deadline = time.monotonic() + 10
    while True:
        after = scrape(base)
        drafted = total(after, "dynabatch:spec_decode_num_draft_tokens_total") - total(
            before, "dynabatch:spec_decode_num_draft_tokens_total"
        )
        if drafted > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert drafted > 0
    accepted = total(after, "dynabatch:spec_decode_num_accepted_tokens_total")
    assert 0 <= accepted <= total(after, "dynabatch:spec_decode_num_draft_tokens_total")


def test_engine_metrics_need_no_controller(serve_cluster):
    """With controller.enabled false, /metrics still shows the engine replica, and its
    counters move with the requests it serves."""
    from ray import serve

    from serve_app import build_app
    from tests.local_serve import app_args

    args = app_args(
        serve_cluster.model,
        controller={"enabled": False},
        engine_replicas={"num_replicas": 1, "num_cpus": 0.25},
    )
    serve.run(build_app(args), name="solo", route_prefix="/solo")
    try:
        base = f"{serve_cluster.base_url}/solo"
        deadline = time.monotonic() + 30
        while total(scrape(base), "dynabatch:num_engine_replicas") != 1:
            assert time.monotonic() < deadline, "the engine replica never showed in /metrics"
            time.sleep(0.25)
        body = {"model": "tiny", "prompt": "no controller", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        while total(scrape(base), "dynabatch:generation_tokens_total") != 4:
            assert time.monotonic() < deadline, "engine counters did not move"
            time.sleep(0.25)
    finally:
        serve.delete("solo")
