"""The request fields that ask for structured output, read into one StructuredOutput: OpenAI's
`response_format` (json_object, json_schema) and vLLM's `structured_outputs` (json, regex,
choice, grammar, json_object) and older `guided_*` fields. At most one may ask."""

from __future__ import annotations

import json
from typing import Any

from engine.core.errors import InvalidParam
from engine.core.sampling_params import StructuredOutput

# vLLM's older top-level fields: name -> the structured_outputs key they mean.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_output(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> StructuredOutput | None:
    """The one structured output the fields ask for, or None. Raises InvalidParam naming the
    field that is malformed or asks a second time."""
    asked: list[StructuredOutput] = []
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            asked.append(spec)
    if structured_outputs:
        keys = [k for k, v in structured_outputs.items() if v not in (None, False)]
        for key in keys:
            asked.append(_vllm_field(f"structured_outputs.{key}", key, structured_outputs[key]))
    for name, key in GUIDED_FIELDS.items():
        if guided.get(name) is not None:
            asked.append(_vllm_field(name, key, guided[name]))
    if len(asked) > 1:
        raise InvalidParam(
            asked[1].param, f"{asked[1].param}: only one structured output per request"
        )
    return asked[0] if asked else None


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise InvalidParam(
            "response_format",
            f"response_format: type must be text, json_object or json_schema, got {kind!r}",
        )
    body = value.get("json_schema")
    schema = body.get("schema") if isinstance(body, dict) else None
    if not isinstance(schema, dict):
        raise InvalidParam(
            "response_format", "response_format: json_schema needs a `schema` object"
        )
    return StructuredOutput("json", json.dumps(schema))


def _vllm_field(param: str, key: str, value: Any) -> StructuredOutput:
    if key == "json" and isinstance(value, dict | str):
        text = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutput("json", text, param=param)
    if key == "json_object" and value is True:
        return StructuredOutput("json_object", param=param)
    if key in ("regex", "grammar") and isinstance(value, str) and value:
        return StructuredOutput(key, value, param=param)
    choices = isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)
    if key == "choice" and choices:
        return StructuredOutput("choice", choices=tuple(value), param=param)
    expected = {
        "json": "a JSON schema",
        "json_object": "true",
        "regex": "a non-empty string",
        "grammar": "a non-empty string",
        "choice": "a non-empty list of non-empty strings",
    }.get(key)
    if expected is None:
        raise InvalidParam(param, f"{param}: unknown structured output {key!r}")
    raise InvalidParam(param, f"{param} must be {expected}")
