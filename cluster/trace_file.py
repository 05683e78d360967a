"""Request traces as JSONL files: one object per line with `arrival_s` (seconds from the
start), `prompt_len` and `output_len` (tokens), and optionally `request_id`, `adapter` and
`model` (the served model a request names, where an app serves several).
A row that is not such an object is an error naming its line and field."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.workload import SimRequest


class TraceError(ValueError):
    """A trace file's row is malformed (the message names the file, line and field)."""


def load_trace(path: str | Path) -> list[SimRequest]:
    """The trace's requests in arrival order."""
    out = []
    seen: set[str] = set()
    lines = Path(path).read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue

        def bad(field: str, why: str, _n: int = number) -> TraceError:
            return TraceError(f"{path} line {_n}: {field}: {why}")

        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise bad("row", f"not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise bad("row", "must be a JSON object")
        arrival = row.get("arrival_s")
        if isinstance(arrival, bool) or not isinstance(arrival, int | float) or arrival < 0:
            raise bad("arrival_s", f"must be a number >= 0, got {arrival!r}")
        lengths = []
        for field in ("prompt_len", "output_len"):
            value = row.get(field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(field, f"must be an integer >= 1, got {value!r}")
            lengths.append(value)
        request_id = str(row.get("request_id", f"r{number}"))
        if request_id in seen:
            raise bad("request_id", f"{request_id!r} appears twice")
        seen.add(request_id)
        names = []
        for field in ("adapter", "model"):
            value = row.get(field)
            if value is not None and not isinstance(value, str):
                raise bad(field, f"must be a string or null, got {value!r}")
            names.append(value)
        out.append(SimRequest(request_id, float(arrival), lengths[0], lengths[1], *names))
    if not out:
        raise TraceError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival_s)


def save_trace(requests: list[SimRequest], path: str | Path) -> None:
    lines = [json.dumps(r.__dict__) for r in requests]
    Path(path).write_text("\n".join(lines) + "\n")
