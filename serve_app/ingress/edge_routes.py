"""The ingress's routes beside generation: /v1/models, /v1/models/{id}, /tokenize and
/detokenize (vLLM's shapes) of every model served, and the API keys and the request-size
limit, all reading the replica's `EdgeState` from the FastAPI app's state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.core.errors import InvalidParam
from serve_app.ingress.api_policy import ApiArgs, key_accepted
from serve_app.ingress.served_models import ServedModel, ServedModels
from serve_app.openai.errors import OpenAIError
from serve_app.openai.protocol import ChatMessage


@dataclass
class EdgeState:
    api: ApiArgs
    models: ServedModels
    api_keys: frozenset[str] = frozenset()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


router = APIRouter()


def _edge(request: Request) -> EdgeState:
    return request.app.state.edge


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """Each model, then its LoRA adapters (their `parent` the model, as vLLM lists them)."""
    cards = []
    for served in _edge(request).models.all:
        cards += await served.cards()
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    for card in (await models(request))["data"]:
        if card["id"] == model_id:
            return card
    raise OpenAIError.model_not_found(model_id, _edge(request).models.names)


async def _picked(request: Request, model: str | None) -> ServedModel:
    """The model a tokenizer route's `model` names (None: the first); a 404 naming another."""
    served = await _edge(request).models.pick(model)
    if model is not None and model != served.name:
        raise OpenAIError.model_not_found(model, _edge(request).models.names)
    return served


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    served = await _picked(request, body.model)
    try:
        if body.messages is not None:
            tokens = served.prompts.chat(body.messages)
        elif body.prompt is not None:
            tokens = served.prompts.completion(body.prompt)
        else:
            raise InvalidParam("prompt", "prompt: send `prompt` or `messages`")
    except InvalidParam as exc:
        raise OpenAIError.bad_request(exc) from None
    return {"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    served = await _picked(request, body.model)
    vocab = served.prompts.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        message = f"tokens: token id {bad} is outside the vocabulary [0, {vocab})"
        raise OpenAIError(400, message, param="tokens")
    return {"prompt": served.prompts.tokenizer.decode(body.tokens)}


def install_edge(app: FastAPI) -> None:
    app.include_router(router)
    app.add_middleware(EdgeChecks)


class EdgeChecks:
    """API keys, then the body size, before anything is parsed. Plain ASGI: a streamed
    response's chunks go straight through (Starlette's `@app.middleware("http")` relays each
    one through a memory stream and a task of its own, a fifth of the ingress's CPU per
    streamed token)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        edge: EdgeState | None = None
        if scope["type"] == "http" and "app" in scope:
            edge = getattr(scope["app"].state, "edge", None)
        if edge is None:
            return await self.app(scope, receive, send)
        path, root = scope.get("path", ""), scope.get("root_path", "")
        path = path[len(root) :] if root and path.startswith(root) else path
        headers = Headers(scope=scope)
        if (
            edge.api_keys
            and edge.api.needs_key(path)
            and not key_accepted(headers.get("authorization"), edge.api_keys)
        ):
            message = "a valid API key is required: Authorization: Bearer <key>"
            response = OpenAIError(401, message, code="invalid_api_key").response()
            return await response(scope, receive, send)
        limit = edge.api.max_request_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                return await _too_large(f"request body of {declared} bytes", limit)(
                    scope, receive, send
                )
        elif scope.get("method") in ("POST", "PUT", "PATCH"):
            # No declared size (a chunked body): read it here, no further than the limit;
            # the routes then get it as one message, and `receive` after it.
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return None  # the client left
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > limit:
                    what = f"request body of over {limit} bytes (chunked)"
                    return await _too_large(what, limit)(scope, receive, send)
                more = message.get("more_body", False)
            receive = replayed(b"".join(chunks), receive)
        return await self.app(scope, receive, send)


def replayed(body: bytes, receive: Receive) -> Receive:
    """`receive` whose first message is the whole `body`, read already."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def _too_large(what: str, limit: int) -> Response:
    message = f"{what} is over the limit of {limit}"
    return OpenAIError(413, message, code="request_too_large").response()
