"""The checkpoint's own sampling defaults (its generation_config.json), as vLLM's
`generation_config: auto` takes them: what a request that leaves a field out samples with."""

from __future__ import annotations

import json
from pathlib import Path

from engine.core.errors import InvalidParam
from engine.core.sampling_params import SamplingParams

# generation_config.json's key -> the request field (SamplingParams') it is the default of.
DEFAULTED_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model_dir: str, mode: str) -> dict[str, float | int]:
    """Request field -> default, from `model_dir`'s generation_config.json where `mode` is
    auto (none: {}). Raises InvalidParam naming engine.generation_config where the file sets
    a value no request could (a top_p of 0, say)."""
    path = Path(model_dir) / "generation_config.json"
    if mode == "none" or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    defaults = {
        name: config[key] for key, name in DEFAULTED_FIELDS.items() if config.get(key) is not None
    }
    try:
        SamplingParams(**defaults)
    except (InvalidParam, TypeError) as exc:
        raise InvalidParam(
            "engine.generation_config", f"engine.generation_config: {path}: {exc}"
        ) from None
    return defaults
