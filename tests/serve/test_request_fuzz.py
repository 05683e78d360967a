"""Hypothesis over request bodies (edge floats and ints, wrong types, unknown fields): never a
5xx, never a hang, every 4xx in OpenAI's body naming `param`; afterwards the server serves
normally and every KV block is free."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.local_serve import assert_serves_and_frees

pytestmark = pytest.mark.timeout(600)

EDGE_FLOATS = st.sampled_from([0.0, -0.0, 1e-45, 1e-5, 0.5, 1.0, 2.0, 100.0, -1.0, 1e308, -1e308])
EDGE_INTS = st.sampled_from([0, 1, -1, 2, 255, 2**31, -(2**31), 2**63, 2**64, 2**70, -(2**70)])
WRONG = st.sampled_from([None, "x", [], {}, [1, "a"], {"a": 1}, True])
ANY = st.one_of(EDGE_FLOATS, EDGE_INTS, WRONG, st.text(max_size=8))

FIELDS = {
    "temperature": st.one_of(EDGE_FLOATS, WRONG),
    "top_p": st.one_of(EDGE_FLOATS, WRONG),
    "top_k": st.one_of(EDGE_INTS, WRONG),
    "min_p": st.one_of(EDGE_FLOATS, WRONG),
    "seed": st.one_of(EDGE_INTS, WRONG),
    "max_tokens": st.one_of(st.integers(-2, 6), EDGE_INTS, WRONG),
    "min_tokens": st.one_of(st.integers(0, 8), WRONG),
    "presence_penalty": st.one_of(EDGE_FLOATS, WRONG),
    "frequency_penalty": st.one_of(EDGE_FLOATS, WRONG),
    "repetition_penalty": st.one_of(EDGE_FLOATS, WRONG),
    "logit_bias": st.one_of(
        st.dictionaries(st.sampled_from(["0", "5", "4095", "4096", "-1", "x"]), ANY, max_size=3),
        WRONG,
    ),
    "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3), st.text(max_size=3), WRONG),
    "stop_token_ids": st.one_of(st.lists(EDGE_INTS, max_size=3), WRONG),
    "n": st.one_of(EDGE_INTS, WRONG),
    "logprobs": st.one_of(EDGE_INTS, st.booleans(), WRONG),
    "stream": st.booleans(),
    "priority": st.one_of(EDGE_INTS, WRONG),
    "response_format": st.one_of(st.just({"type": "text"}), WRONG),
    "frobnicate": ANY,  # unknown: ignored
}
BODIES = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=20), st.lists(EDGE_INTS, max_size=3), WRONG)},
    optional=FIELDS,
)


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=BODIES)
def test_no_body_gets_a_5xx_or_a_4xx_without_param(serve_cluster, body):
    body = {"model": "tiny", **body}
    resp = httpx.post(f"{serve_cluster.v1()}/completions", json=body, timeout=60)
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["param"], (body, error)
    elif body.get("stream"):
        lines = resp.text.splitlines()
        assert "data: [DONE]" in lines
        assert not any('"server_error"' in line for line in lines), (body, resp.text)
    else:
        assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length"), body


def test_after_the_fuzz_the_server_serves_and_frees_every_block(serve_cluster):
    assert_serves_and_frees(serve_cluster)
