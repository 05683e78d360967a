"""POST /v1/completions and /v1/chat/completions: each request through the path every request
takes (serve_app/openai/request_path.py) to the engine replicas, answered as SSE events or a
whole body (serve_app/openai/completion_bodies.py). The routes are the OpenAIIngress
class's own (serve_app/ingress/deployment.py), which call its CompletionsService."""

from __future__ import annotations

import contextlib
import time
from functools import partial

from fastapi.responses import JSONResponse, Response

from serve_app.openai.completion_bodies import sse_events, whole_body
from serve_app.openai.errors import OpenAIError
from serve_app.openai.event_stream import EventStream
from serve_app.openai.request_path import Body, RequestPath
from serve_app.transport.streaming import runs_response


class CompletionsService:
    def __init__(self, path: RequestPath) -> None:
        self.path = path

    async def serve(self, endpoint: str, body: Body) -> Response:
        """`endpoint`: "completions" or "chat"."""
        path, metrics = self.path, self.path.metrics
        url = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        with contextlib.ExitStack() as scope:
            span = scope.enter_context(path.span(url, body.model, bool(body.stream)))
            headers, prep = {}, None
            try:
                headers = path.ignored_header(body)
                prep = path.prepare(endpoint, body, await path.adapters.resolve(body.model))
                span.event("prepared")  # validated, templated, tokenized: sent next
                choices = await path.client.start_choices(
                    prep, body.num_sequences, span.carrier(), body.priority
                )
                span.event("first_token")  # at this replica: what remains is the response's
            except OpenAIError as exc:
                metrics.answered(endpoint, exc.status)
                if prep is not None and exc.status in (429, 503):
                    path.record_rejected(prep)
                span.set({"http.response.status_code": exc.status})
                response = exc.response()
                response.headers.update(headers)
                return response
            record = partial(path.record, prep, span, time.perf_counter() - prep.started)
            if body.stream:
                metrics.answered(endpoint, 200)
                runs_response()
                events = sse_events(prep, body.model, choices, record)
                # The response's body outlives this call: it ends the span when it ends.
                return EventStream(events, scope.pop_all(), headers)
            try:
                whole, lasts = await whole_body(prep, body.model, choices)
            except OpenAIError as exc:  # lost with its replica, and no other took it
                metrics.answered(endpoint, exc.status)
                return exc.response()
            record(lasts)
            failed = [last for last in lasts if last.finish_reason == "error"]
            if failed:
                metrics.answered(endpoint, 500)
                message = f"engine error: {failed[0].error}"
                return OpenAIError.server_error(500, message).response()
            metrics.answered(endpoint, 200)
            return JSONResponse(whole, headers=headers)
