"""The ingress's routes beside generation: /v1/models, /v1/models/{id}, /tokenize and
/detokenize (vLLM's shapes), and the request-size limit, all reading the replica's
`EdgeState` from the FastAPI app's state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from engine.core.errors import InvalidParam
from serve_app.ingress.api_policy import ApiArgs, key_accepted
from serve_app.ingress.lora_names import AdapterNames
from serve_app.openai.errors import OpenAIError
from serve_app.openai.prompts import PromptBuilder
from serve_app.openai.protocol import ChatMessage


@dataclass
class EdgeState:
    model_name: str
    max_model_len: int
    prompts: PromptBuilder
    api: ApiArgs
    root: str  # the checkpoint directory
    created: int
    api_keys: frozenset[str] = frozenset()
    adapters: AdapterNames | None = None  # LoRA adapters, listed as models of their own

    def card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "dynabatch",
            "root": self.root,
            "max_model_len": self.max_model_len,
        }


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


def _edge(request: Request, model: str | None) -> EdgeState:
    edge: EdgeState = request.app.state.edge
    if model is not None and model != edge.model_name:
        raise OpenAIError.model_not_found(model, edge.model_name)
    return edge


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The base model, then each LoRA adapter (its `parent` the base, as vLLM lists them)."""
    edge = _edge(request, None)
    base = edge.card()
    cards = [base]
    if edge.adapters is not None:
        for name, path in (await edge.adapters.listed()).items():
            cards.append(base | {"id": name, "root": path, "parent": edge.model_name})
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    edge: EdgeState = request.app.state.edge
    for card in (await models(request))["data"]:
        if card["id"] == model_id:
            return card
    raise OpenAIError.model_not_found(model_id, edge.model_name)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    edge = _edge(request, body.model)
    try:
        if body.messages is not None:
            tokens = edge.prompts.chat(body.messages)
        elif body.prompt is not None:
            tokens = edge.prompts.completion(body.prompt)
        else:
            raise InvalidParam("prompt", "prompt: send `prompt` or `messages`")
    except InvalidParam as exc:
        raise OpenAIError.bad_request(exc) from None
    return {"count": len(tokens), "max_model_len": edge.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    edge = _edge(request, body.model)
    vocab = edge.prompts.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        message = f"tokens: token id {bad} is outside the vocabulary [0, {vocab})"
        raise OpenAIError(400, message, param="tokens")
    return {"prompt": edge.prompts.tokenizer.decode(body.tokens)}


def install_edge(app: FastAPI) -> None:
    app.include_router(router)

    @app.middleware("http")
    async def edge_checks(request: Request, call_next) -> Response:
        """API keys, then the body size, before anything is parsed."""
        edge: EdgeState | None = getattr(request.app.state, "edge", None)
        if edge is None:
            return await call_next(request)
        path, root = request.url.path, request.scope.get("root_path", "")
        path = path[len(root) :] if root and path.startswith(root) else path
        authorization = request.headers.get("authorization")
        if (
            edge.api_keys
            and edge.api.needs_key(path)
            and not key_accepted(authorization, edge.api_keys)
        ):
            message = "a valid API key is required: Authorization: Bearer <key>"
            return OpenAIError(401, message, code="invalid_api_key").response()
        limit = edge.api.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                return _too_large(f"request body of {declared} bytes", limit)
        elif request.method in ("POST", "PUT", "PATCH"):
            # No declared size (a chunked body): read it here, no further than the limit;
            # the routes then get the body read (Starlette hands it on).
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return _too_large(f"request body of over {limit} bytes (chunked)", limit)
                chunks.append(chunk)
            request._body = b"".join(chunks)
        return await call_next(request)


def _too_large(what: str, limit: int) -> Response:
    message = f"{what} is over the limit of {limit}"
    return OpenAIError(413, message, code="request_too_large").response()
