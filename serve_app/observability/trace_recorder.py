"""TraceRecorder: an ingress replica's rows of its requests (serve_app/observability/
traffic_trace.py), sent to the app's TrafficTrace in batches every `flush_s` from the
replica's event loop. A replica that dies loses the rows of its last interval at most; while
the trace does not answer, rows wait, up to `max_pending` (then the oldest are dropped and
counted)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cluster.app_tables import Table
from serve_app.observability.traffic_trace import Row

logger = logging.getLogger(__name__)


class TraceRecorder:
    def __init__(self, trace: Table, flush_s: float, max_pending: int = 10_000) -> None:
        self.trace, self.flush_s, self.max_pending = trace, flush_s, max_pending
        self.num_dropped = 0
        self._pending: list[Row] = []
        self._sender: asyncio.Task | None = None

    def add(self, row: Row) -> None:
        self._pending.append(row)
        self._bound()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_while_pending())

    async def rows(self, since: float, until: float) -> list[Row]:
        """The app's rows in [since, until), this replica's own sent first."""
        await self.flush()
        return await self.trace.rows.remote(since, until)

    async def flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            await self.trace.append.remote(batch)
        except Exception as exc:  # the trace restarting: keep them for the next interval
            logger.warning("traffic trace unavailable, %d rows kept: %r", len(batch), exc)
            self._pending = batch + self._pending
            self._bound()
            raise

    async def _send_while_pending(self) -> None:
        while self._pending:
            await asyncio.sleep(self.flush_s)
            with contextlib.suppress(Exception):  # (logged) tried again after the next interval
                await self.flush()

    def _bound(self) -> None:
        excess = len(self._pending) - self.max_pending
        if excess > 0:
            del self._pending[:excess]
            self.num_dropped += excess
