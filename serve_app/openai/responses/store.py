"""ResponseStore: the Responses API's stored responses, one table for every ingress replica
(in the app's AppTables actor, cluster/app_tables.py, so a response outlives the ingress
replica that made it), bounded in count (least recently used leave first) and in age (a TTL).

Each record is plain data: the response object, the conversation it ends (chat messages:
what `previous_response_id` continues), and whether a cancel was asked for (a background
response runs at one ingress replica; a cancel may come through another)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

# The response statuses a cancel may still change.
_RUNNING = ("queued", "in_progress")


class ResponseStore:
    def __init__(self, max_responses: int, ttl_s: float) -> None:
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self._records: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        """Store (or replace) a record. A response cancelled before stays cancelled: its
        runner may store it once more before it sees the cancel."""
        old = self._get(response_id)
        if old is not None and old.get("cancel"):
            cancelled = record["response"] | {"status": "cancelled"}
            record = record | {"cancel": True, "response": cancelled}
        self._records[response_id] = (time.monotonic(), record)
        self._records.move_to_end(response_id)
        while len(self._records) > self.max_responses:
            self._records.popitem(last=False)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return self._get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self._records.pop(response_id, None) is not None

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        """Mark a running response cancelled (its runner stops it); None if unknown."""
        record = self._get(response_id)
        if record is None:
            return None
        if record["response"]["status"] in _RUNNING:
            response = record["response"] | {"status": "cancelled"}
            record = record | {"response": response, "cancel": True}
            self._records[response_id] = (self._records[response_id][0], record)
        return record

    async def cancelled(self, response_id: str) -> bool:
        record = self._get(response_id)
        return bool(record and record.get("cancel"))

    def _get(self, response_id: str) -> dict[str, Any] | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if time.monotonic() - entry[0] > self.ttl_s:
            del self._records[response_id]
            return None
        self._records.move_to_end(response_id)
        return entry[1]
