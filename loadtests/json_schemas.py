"""Random JSON schemas of the shapes apps send (nested objects, enums, arrays, bounded
numbers, required fields), for the structured-output tests and benchmark."""

from __future__ import annotations

import random
from typing import Any


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema of 1-4 properties; objects nest two levels at most."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"]
    if depth < 2:
        kinds.append("object")
    properties: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            prop = {"type": "string", "maxLength": rng.randint(1, 8)}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
        elif kind == "number":
            prop = {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", "amber", "teal"], 3)}
        elif kind == "array":
            digit = {"type": "integer", "minimum": 0, "maximum": 9}
            items = rng.choice([digit, {"enum": ["x", "y"]}])
            prop = {"type": "array", "items": items, "maxItems": rng.randint(0, 3)}
        else:
            prop = random_schema(rng, depth + 1)
        properties[f"f{i}_{kind}"] = prop
    required = [k for k in properties if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
