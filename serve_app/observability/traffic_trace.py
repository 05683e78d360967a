"""TrafficTrace: an app's record of its own traffic, one row per request that ended or was
turned away (arrival, model, adapter, token counts, finish reason, latencies; never text),
from every ingress replica, bounded by count and age (deploy.yaml `trace:`); a table of the
app's AppTables (cluster/app_tables.py). GET /v1/cluster/trace answers it as the tuner's JSONL
(cluster/trace_file.py), which `python -m cluster.tune --from-url` reads.

A row is a plain dict: `request_id`, `arrival_unix` (wall-clock seconds), `model`,
`adapter`, `prompt_len`, `output_len`, `cached_prompt_len`, `finish_reason`, `ttft_s`,
`e2e_s` and `rejected` (answered 429 or 503 before it ran; its `output_len` is the
max_tokens it asked for).
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

Row = dict[str, Any]


class TrafficTrace:
    def __init__(self, max_rows: int, max_age_s: float) -> None:
        self.max_rows, self.max_age_s = max_rows, max_age_s
        self._rows: deque[Row] = deque()  # in the order they came (about that of ending)

    async def append(self, rows: list[Row]) -> None:
        oldest = time.time() - self.max_age_s
        self._rows.extend(row for row in rows if row["arrival_unix"] >= oldest)
        self._trim()

    async def rows(self, since: float, until: float) -> list[Row]:
        """The rows that arrived in [since, until) and within max_age_s, in arrival order."""
        self._trim()
        since = max(since, time.time() - self.max_age_s)
        found = [row for row in self._rows if since <= row["arrival_unix"] < until]
        return sorted(found, key=lambda row: row["arrival_unix"])

    def _trim(self) -> None:
        while len(self._rows) > self.max_rows:
            self._rows.popleft()
        oldest = time.time() - self.max_age_s
        while self._rows and self._rows[0]["arrival_unix"] < oldest:
            self._rows.popleft()


_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_instant(text: str, now: float) -> float:
    """A query's time: wall-clock seconds, or a span before `now` ("90s", "30m", "24h",
    "7d"). Raises ValueError saying what it takes."""
    ago = _AGO.match(text.strip())
    if ago:
        return now - float(ago.group(1)) * _UNIT_S[ago.group(2)]
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither seconds since the epoch nor a span such as 90s, 30m, 24h, 7d"
        ) from None
    if not value >= 0:
        raise ValueError(f"{text!r} is before the epoch")
    return value


def trace_lines(rows: Iterable[Row]) -> Iterable[str]:
    """The rows as the tuner's JSONL: `arrival_s` counted from the first row's arrival,
    `output_len` at least 1 (a request that ended before its first token), the row's other
    fields beside."""
    start = None
    for row in rows:
        start = row["arrival_unix"] if start is None else start
        line = row | {
            "arrival_s": round(row["arrival_unix"] - start, 6),
            "output_len": max(row["output_len"], 1),
        }
        yield json.dumps(line) + "\n"
