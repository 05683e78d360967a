"""Hypothesis against the server's own /openapi.json: for every JSON-body route, bodies drawn
from its published schema (valid ones, and anything JSON at all): never a 5xx, never a hang,
every 4xx in OpenAI's error body; afterwards the server serves and every KV block is free."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.local_serve import assert_serves_and_frees

pytestmark = pytest.mark.timeout(600)

# No subnormal floats: the CPU kernels loaded by other tests set flush-to-zero in this process,
# where hypothesis refuses to draw them.
FLOATS = {"allow_nan": False, "allow_infinity": False, "allow_subnormal": False}
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(**FLOATS) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)


def _json_routes(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(path, body schema) of every operation that takes a JSON body."""
    routes = []
    for path, operations in spec["paths"].items():
        for op in operations.values():
            content = (op.get("requestBody") or {}).get("content", {})
            if "application/json" in content:
                routes.append((path, content["application/json"]["schema"]))
    return routes


def _bodies(spec: dict[str, Any], schema: dict[str, Any]) -> st.SearchStrategy:
    """Bodies valid for `schema` (its $refs into the spec's components resolved), or any JSON."""
    return st.one_of(_from_schema(spec, schema, depth=0).map(_short), JSON)


def _from_schema(spec: dict[str, Any], schema: dict[str, Any], depth: int) -> st.SearchStrategy:
    """Values of a (pydantic-made) JSON schema: the keywords FastAPI's openapi.json uses."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return _from_schema(spec, spec["components"]["schemas"][name], depth)
    if "anyOf" in schema:
        return st.one_of([_from_schema(spec, s, depth) for s in schema["anyOf"]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum", [schema.get("const")]))
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        if depth > 3:
            return st.just({})
        required = set(schema.get("required", ()))
        fields = {k: _from_schema(spec, v, depth + 1) for k, v in props.items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    if kind == "array":
        items = _from_schema(spec, schema.get("items", {}), depth + 1)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, 3))
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=max(low, 12))
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            low = schema["exclusiveMinimum"] + 1
        if "exclusiveMaximum" in schema:
            high = schema["exclusiveMaximum"] - 1
        return st.integers(low, high)
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.floats(low, high, **FLOATS)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON  # no constraint


def _short(body: Any) -> Any:
    """The body with short generations (each example stays quick) for the served model."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > 8:
                body[key] = 8
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
        if isinstance(body.get("best_of"), int) and body["best_of"] > 2:
            body["best_of"] = 2
        if "model" in body:  # the served model: the bodies reach the engine
            body["model"] = "tiny"
    return body


def test_every_route_survives_bodies_drawn_from_its_schema(serve_cluster):
    spec = httpx.get(f"{serve_cluster.base_url}/openapi.json", timeout=30).json()
    routes = _json_routes(spec)
    paths = {path for path, _ in routes}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= paths
    route = st.sampled_from(routes).flatmap(lambda r: st.tuples(st.just(r[0]), _bodies(spec, r[1])))

    @settings(
        max_examples=120,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=route)
    def check(case: tuple[str, Any]) -> None:
        path, body = case
        resp = httpx.post(f"{serve_cluster.base_url}{path}", json=body, timeout=60)
        assert resp.status_code < 500, (path, body, resp.text)
        if resp.status_code >= 400:
            assert set(resp.json()) == {"error"}, (path, body, resp.text)

    check()
    assert_serves_and_frees(serve_cluster)
