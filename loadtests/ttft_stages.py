"""Where a streamed request's first token spends its time over HTTP, stage by stage, from the
app's trace spans (tracing exporter `file`) and the client's own clock.

Stages, each a median over requests in milliseconds:
- `client_to_ingress`: the client sends, until the ingress's server span starts (the socket,
  HTTP parsing, routing to the handler);
- `ingress_prepares`: the server span's start until the request is ready to send (validated,
  the chat template applied, tokenized);
- `ingress_to_engine`: from there until the engine replica's span starts (Serve's routing,
  the Ray call, the replica's event loop taking it);
- `engine`: the engine span's start until its first token (queue, scheduling, the prefill
  step, detokenization): what the in-process engine's TTFT measures too;
- `engine_to_ingress`: the engine's first token until the ingress has it (the Ray stream's
  first item);
- `ingress_to_client`: the ingress has the first token until the client reads its event (the
  SSE chunk encoded and written, the client's read).

A client's request is matched to its server span by the response's id (the span's
`dynabatch.request_id`), and to its engine span as that span's child.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from loadtests.closed_loop import RequestTiming

# perf_counter readings as wall-clock nanoseconds (the spans' clock), this process's offset.
_WALL_OFFSET_NS = time.time_ns() - time.perf_counter_ns()

STAGES = ("client_to_ingress", "ingress_prepares", "ingress_to_engine", "engine")
STAGES += ("engine_to_ingress", "ingress_to_client")


def wall_ns(perf_s: float) -> int:
    return int(perf_s * 1e9) + _WALL_OFFSET_NS


def _event(span: dict[str, Any], name: str) -> int | None:
    return next((e["time_ns"] for e in span["events"] if e["name"] == name), None)


def ttft_stages(spans_file: Path, timings: list[RequestTiming]) -> dict[str, float]:
    """Medians (ms) of each stage over the requests in `timings` whose spans were found, and
    `matched`: how many were."""
    spans = [json.loads(line) for line in spans_file.read_text().splitlines() if line]
    servers = {}  # by the response's id
    for s in spans:
        if s["name"].startswith("POST "):
            servers[s["attributes"].get("dynabatch.request_id")] = s
    engines: dict[str, dict[str, Any]] = {}
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        if s["name"] == "engine.generate":
            engines.setdefault(s["parent_span_id"], s)  # a resumed request: its first replica
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    for t in timings:
        server = servers.get(t.request_id)
        engine = engines.get(server["span_id"]) if server is not None else None
        if t.first_token is None or server is None or engine is None:
            continue
        prepared = _event(server, "prepared")
        at_ingress, at_engine = _event(server, "first_token"), _event(engine, "first_token")
        if prepared is None or at_ingress is None or at_engine is None:
            continue
        marks = [
            wall_ns(t.start),
            server["start_ns"],
            prepared,
            engine["start_ns"],
            at_engine,
            at_ingress,
            wall_ns(t.first_token),
        ]
        for name, a, b in zip(STAGES, marks, marks[1:], strict=False):
            stages[name].append((b - a) / 1e6)
    matched = len(stages["engine"])
    result = {name: statistics.median(v) if v else float("nan") for name, v in stages.items()}
    result["matched"] = matched
    return result
