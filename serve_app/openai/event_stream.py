"""EventStream: a streamed response's SSE events, written straight to the connection."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStream(Response):
    """text/event-stream from `events`; `scope` (the request's span, its record) closes when
    the stream ends, also when the client leaves early.

    Unlike Starlette's StreamingResponse it starts no task group to watch for the client's
    disconnect beside the stream: Serve cancels the request's task when its client leaves
    (that closes `events`, which cancels the engine request), and the events go out from the
    task that runs the route (serve_app/transport/streaming.py, `runs_response`)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        scope: contextlib.ExitStack,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.events = events
        self.scope = scope
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with self.scope:
            async with contextlib.aclosing(self.events) as events:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                async for event in events:
                    body = event.encode()
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
