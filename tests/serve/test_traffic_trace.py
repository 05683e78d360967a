"""The app's record of its own traffic (deploy.yaml `trace:`): requests of known lengths come
back from GET /v1/cluster/trace with those lengths, their adapter, finish reason and
latencies, and no text; the bounds hold; a bad `since` or `until` is a 400 naming it;
`python -m cluster.tune --from-url` tunes on what the app recorded. (Rejected requests'
rows: tests/serve/test_backpressure_and_routing.py, on the `narrow` app that answers 429.)"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from cluster.trace_file import load_trace
from cluster.tune.cli import main as tune_main
from serve_app.observability.traffic_trace import TrafficTrace, parse_instant, trace_lines
from tests.local_serve import EMULATED, app_args

pytestmark = pytest.mark.timeout(300)

ROW_FIELDS = {
    "request_id",
    "arrival_unix",
    "arrival_s",
    "model",
    "adapter",
    "prompt_len",
    "output_len",
    "cached_prompt_len",
    "finish_reason",
    "ttft_s",
    "e2e_s",
    "rejected",
}


def recorded(base_url: str, since: float, **headers: str) -> list[dict]:
    resp = httpx.get(f"{base_url}/v1/cluster/trace", params={"since": since}, headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in resp.text.splitlines()]


def test_requests_come_back_from_the_trace_with_their_lengths(serve_cluster, tmp_path):
    started = time.time()
    client = openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)
    sent = {}
    for i, (prompt_len, max_tokens, model) in enumerate([(5, 3, "tiny"), (9, 4, "sql")]):
        prompt = [100 + i + j for j in range(prompt_len)]
        kwargs = {"max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}
        answer = client.completions.create(model=model, prompt=prompt, **kwargs)
        sent[answer.id] = (prompt_len, max_tokens, None if model == "tiny" else model)
    stream = client.completions.create(
        model="tiny", prompt="a streamed one", max_tokens=6, stream=True, temperature=0
    )
    streamed_id = [chunk.id for chunk in stream][0]
    rows = {row["request_id"]: row for row in recorded(serve_cluster.base_url, started)}
    for request_id, (prompt_len, max_tokens, adapter) in sent.items():
        row = rows[request_id]
        assert set(row) == ROW_FIELDS  # lengths and times only: no prompt, no text
        assert (row["prompt_len"], row["output_len"], row["adapter"]) == (
            prompt_len, max_tokens, adapter,
        )  # fmt: skip
        assert (row["model"], row["finish_reason"], row["rejected"]) == ("tiny", "length", False)
        assert 0 < row["ttft_s"] <= row["e2e_s"] and started <= row["arrival_unix"]
        assert 0 <= row["cached_prompt_len"] < prompt_len
    assert rows[streamed_id]["finish_reason"] in ("length", "stop")
    arrivals = [row["arrival_unix"] for row in rows.values()]
    assert arrivals == sorted(arrivals) and min(row["arrival_s"] for row in rows.values()) == 0
    # The tuner reads it as it is, straight from the app.
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows.values()))
    assert len(load_trace(trace)) == len(rows)
    argv = ["--from-url", serve_cluster.base_url, "--since", str(started), "--slo", "ttft=2"]
    argv += ["--model", "Llama-2-7B", "--gpu", "H100-80GB", "--trials", "2", "--workers", "1"]
    argv += ["--set", "max_num_seqs=64", "--set", "max_replicas=1", "--out", str(tmp_path / "t")]
    result = tune_main(argv)
    assert result["models"]["tiny"]["trials"] >= 1
    assert len(load_trace(tmp_path / "t" / "trace.jsonl")) >= len(rows)


def test_a_bad_bound_is_a_400_naming_it(serve_cluster):
    url = f"{serve_cluster.base_url}/v1/cluster/trace"
    for params, field in (({"since": "yesterday"}, "since"), ({"until": "-5"}, "until")):
        resp = httpx.get(url, params=params)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
    resp = httpx.get(url, params={"since": "1h", "until": "2h"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "until"
    # The narrow app asks for its API key here as on every /v1 route.
    assert httpx.get(f"{serve_cluster.base_url}/narrow/v1/cluster/trace").status_code == 401


def test_the_trace_keeps_its_bounds_and_answers_in_arrival_order():
    trace = TrafficTrace(max_rows=3, max_age_s=60.0)
    now = time.time()

    def row(i: int, arrival: float) -> dict:
        return {"request_id": f"r{i}", "arrival_unix": arrival, "output_len": 0}

    # Two ingress replicas' batches, each in the order its requests ended.
    asyncio.run(trace.append([row(0, now - 300), row(1, now - 5)]))
    asyncio.run(trace.append([row(2, now - 3), row(3, now - 9), row(4, now - 1)]))
    kept = asyncio.run(trace.rows(0.0, now + 1))
    assert [r["request_id"] for r in kept] == ["r3", "r2", "r4"]  # 3 newest, by arrival
    asyncio.run(trace.append([row(5, now - 120)]))  # older than max_age_s: gone at once
    assert [r["request_id"] for r in asyncio.run(trace.rows(0.0, now + 1))] == ["r3", "r2", "r4"]
    assert [r["request_id"] for r in asyncio.run(trace.rows(now - 4, now - 1))] == ["r2"]
    lines = [json.loads(line) for line in trace_lines(kept)]
    assert [line["arrival_s"] for line in lines] == [0.0, 6.0, 8.0]
    assert all(line["output_len"] == 1 for line in lines)  # ended before a token: 1
    assert parse_instant("90s", 1000.0) == 910.0 and parse_instant("2h", 1e4) == 1e4 - 7200
    assert parse_instant("1700000000.5", 0.0) == 1700000000.5
    for bad in ("yesterday", "-5", "5w", "nan"):
        with pytest.raises(ValueError):
            parse_instant(bad, 0.0)


# An app of two ingress replicas and one emulated engine replica that runs one request at a
# time (no CPU reserved: the session's are taken), tuning itself every 4 s on the last 30 s
# of its traffic against a TTFT of 0.5 s: max_num_seqs 1 or 4.
TWO_INGRESS = EMULATED | {
    "engine": EMULATED["engine"] | {"max_num_seqs": 1},
    "engine_replicas": {"num_replicas": 1, "num_cpus": 0},
    "ingress_replicas": {"num_replicas": 2, "num_cpus": 0},
    "trace": {"flush_s": 0.2},
    "tuning": {
        "auto": True,
        "period_s": 4.0,
        "window_s": 30.0,
        "trials": 2,
        "min_requests": 8,
        "ttft_s": 0.5,
        "space": {"max_num_seqs": [1, 4]},
        "num_cpus": 0,
    },
}


@pytest.fixture(scope="module")
def two_ingress(serve_cluster):
    from ray import serve

    from serve_app import build_app

    args = app_args(serve_cluster.model, **TWO_INGRESS)
    serve.run(build_app(args), name="twoingress", route_prefix="/twoingress")
    try:
        yield f"{serve_cluster.base_url}/twoingress"
    finally:
        serve.delete("twoingress", _blocking=False)


def test_two_ingress_replicas_rows_come_back_merged_in_arrival_order(serve_cluster, two_ingress):
    """Requests of known lengths spread over both ingress replicas come back from either
    one's /v1/cluster/trace, each with its lengths, in arrival order."""
    from ray import serve

    started = time.time()
    client = openai.AsyncOpenAI(base_url=f"{two_ingress}/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}

    async def one(i: int) -> tuple[str, int, int]:
        prompt = [200 + j for j in range(3 + i)]
        answer = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=2 + i, extra_body=extra
        )
        return answer.id, 3 + i, 2 + i

    async def all_of_them() -> list[tuple[str, int, int]]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    sent = asyncio.run(all_of_them())
    # Both ingress replicas sent requests: the engine replica holds a delta channel each.
    handle = serve.get_deployment_handle("EngineServer", app_name="twoingress")
    assert handle.stats.remote().result(timeout_s=10)["num_channels"] == 2
    time.sleep(0.6)  # the other replica's last rows: within its flush period
    rows = recorded(two_ingress, started)
    assert [r["arrival_unix"] for r in rows] == sorted(r["arrival_unix"] for r in rows)
    by_id = {row["request_id"]: row for row in rows}
    for request_id, prompt_len, output_len in sent:
        row = by_id[request_id]
        assert (row["prompt_len"], row["output_len"]) == (prompt_len, output_len), row


def test_the_app_tunes_itself_on_its_recorded_traffic(two_ingress):
    """deploy.yaml `tuning.auto`: on the 16 requests above, within a few periods the
    controller's tuner applies max_num_seqs 4, the cheapest setting the simulator predicts
    meets the objectives (because the setting in force misses them, or costs more: which
    one depends on how the host spread the requests' arrivals), and /metrics counts it."""
    url = f"{two_ingress}/v1/cluster/settings"

    def applied() -> dict | None:
        shown = httpx.get(url, timeout=10).json()
        return shown if shown["source"] == "applied" else None

    deadline = time.monotonic() + 40
    while (shown := applied()) is None and time.monotonic() < deadline:
        time.sleep(1)
    assert shown is not None, httpx.get(f"{two_ingress}/v1/cluster", timeout=10).json()
    assert shown["engine"]["max_num_seqs"] == 4 and shown["version"] == 1, shown
    view = httpx.get(f"{two_ingress}/v1/cluster", timeout=10).json()
    change = view["tuning"]["last_change"]
    reasons = ("the setting in force misses the target", "fewer replica-hours at")
    assert change["kind"] == "apply" and any(r in change["reason"] for r in reasons), change
    metrics = httpx.get(f"{two_ingress}/metrics", timeout=10).text
    counted = [
        line
        for line in metrics.splitlines()
        if line.startswith("dynabatch:tuning_applied_total{") and 'kind="apply"' in line
    ]
    assert len(counted) == 1 and counted[0].endswith(" 1.0"), (counted, view["tuning"])
    assert 'model_name="tiny"' in counted[0]
    info = [line for line in metrics.splitlines() if line.startswith("dynabatch:tuning_setting")]
    assert len(info) == 1 and 'max_num_seqs="4"' in info[0] and 'version="1"' in info[0], info
