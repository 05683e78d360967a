"""OpenTelemetry: one streaming request gives an ingress span and an engine-replica child
span with the same trace id, the engine's life-cycle events, and the request's attributes."""

from __future__ import annotations

import json
import time

import pytest

from tests.local_serve import ServeCluster, app_args

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def traced_app(serve_cluster: ServeCluster, tmp_path_factory):
    from ray import serve

    from serve_app import build_app

    path = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    args = app_args(
        serve_cluster.model,
        tracing={"exporter": "file", "file_path": str(path)},
        engine_replicas={"num_replicas": 1, "num_cpus": 0.25},
        controller={"enabled": False},
    )
    serve.run(build_app(args), name="traced", route_prefix="/traced")
    try:
        yield f"{serve_cluster.base_url}/traced", path
    finally:
        serve.delete("traced")


def read_spans(path, want: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        spans = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if len(spans) >= want or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def test_streaming_request_makes_a_two_process_span_tree(traced_app):
    from openai import OpenAI

    base, path = traced_app
    client = OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="trace me",
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks
    spans = read_spans(path, 2)
    ingress = [s for s in spans if s["name"] == "POST /v1/completions"]
    engine = [s for s in spans if s["name"] == "engine.generate"]
    assert len(ingress) == 1 and len(engine) == 1, [s["name"] for s in spans]
    (root,), (child,) = ingress, engine
    assert root["trace_id"] == child["trace_id"]
    assert child["parent_span_id"] == root["span_id"] and root["parent_span_id"] is None
    assert root["resource"]["dynabatch.role"] == "ingress"
    assert child["resource"]["dynabatch.role"] == "engine"
    assert root["resource"]["process.pid"] != child["resource"]["process.pid"]
    # Request attributes on both sides.
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert root["attributes"]["dynabatch.finish_reason"] == "length"
    rid = root["attributes"]["dynabatch.request_id"]
    assert child["attributes"]["dynabatch.request_id"] == rid
    assert child["attributes"]["dynabatch.output_tokens"] == 6
    assert child["attributes"]["dynabatch.replica"]
    # The engine's life-cycle, in time order, inside the ingress span.
    events = sorted(child["events"], key=lambda e: e["time_ns"])
    assert [e["name"] for e in events] == ["queued", "scheduled", "first_token", "finished"]
    assert events[-1]["attributes"]["finish_reason"] == "length"
    assert root["start_ns"] <= child["start_ns"] <= child["end_ns"] <= root["end_ns"]
    # The ingress's own stages around the engine's (loadtests/ttft_stages.py reads them).
    marks = {e["name"]: e["time_ns"] for e in root["events"]}
    assert marks["prepared"] <= child["start_ns"], (marks, child["start_ns"])
    assert events[2]["time_ns"] <= marks["first_token"], (marks, events)
