"""GenerationRoutes: POST /v1/completions and /v1/chat/completions with a JSON body, answered
as plain ASGI before FastAPI's router.

These two routes carry nearly every request and every streamed chunk. Through FastAPI a request
also pays for the router's matching over every route, a Request and its headers, the
dependency solver and the route's wrappers; and each chunk of a streamed response passes two
more send wrappers (Starlette's exception handling, once for the app and once for the route).
Here the body is read, parsed and validated as FastAPI does it, errors answer with the same
bodies (serve_app/openai/errors.py), and the request goes to the same CompletionsService.
The class's own routes (serve_app/ingress/deployment.py) stay for /openapi.json and for
bodies that are not JSON (whose errors FastAPI words)."""

from __future__ import annotations

import json

from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.ingress.edge_routes import replayed
from serve_app.ingress.served_models import ServedModels
from serve_app.openai import protocol as oai
from serve_app.openai.errors import OpenAIError, validation_error_response

_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_BODIES: dict[str, type[oai.CompletionRequest] | type[oai.ChatCompletionRequest]] = {
    "completions": oai.CompletionRequest,
    "chat": oai.ChatCompletionRequest,
}


def _is_json(scope: Scope) -> bool:
    """The request says its body is JSON (application/json or application/*+json), the
    bodies FastAPI parses as JSON."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            main, _, sub = kind.partition(b"/")
            return main == b"application" and (sub == b"json" or sub.endswith(b"+json"))
    return False


async def _body(receive: Receive) -> bytes | None:
    """The whole request body; None where the client left first."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


class GenerationRoutes:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = models = None
        if scope["type"] == "http" and scope.get("method") == "POST" and "app" in scope:
            path, root = scope.get("path", ""), scope.get("root_path", "")
            endpoint = _ENDPOINTS.get(path[len(root) :] if root and path.startswith(root) else path)
            if endpoint is not None:
                models = getattr(scope["app"].state, "models", None)
        if models is None or not _is_json(scope):
            return await self.app(scope, receive, send)
        body = await _body(receive)
        if body is None:
            return None  # the client left
        if not body:  # FastAPI's own 400 for a missing body
            return await self.app(scope, replayed(body, receive), send)
        response = await self._answer(models, endpoint, body)
        await response(scope, receive, send)

    @staticmethod
    async def _answer(models: ServedModels, endpoint: str, body: bytes) -> Response:
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:  # as FastAPI words it
            error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error"}
            return validation_error_response([error | {"ctx": {"error": exc.msg}}])
        except (ValueError, RecursionError):  # not UTF-8, nested too deep
            return OpenAIError(400, "There was an error parsing the body").response()
        try:
            request = _BODIES[endpoint].model_validate(data)
        except ValidationError as exc:
            return validation_error_response(exc.errors(include_url=False))
        try:
            served = await models.pick(request.model)
            return await served.completions.serve(endpoint, request)
        except OpenAIError as exc:
            return exc.response()
