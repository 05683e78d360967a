"""POST /v1/embeddings: each input runs through an engine replica as an embedding request
(prefill only; its prompt's final hidden states pooled as the checkpoint publishes it,
engine/model/pooling_config.py), in the same batches as generation; `dimensions` truncates
(renormalized) where the model allows, `encoding_format` base64 packs little-endian
float32 as OpenAI's."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import struct
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from engine.core.errors import InvalidParam
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.model.loader import read_spec
from engine.model.pooling_config import read_embedding_config
from serve_app.openai.errors import OpenAIError
from serve_app.openai.request_path import RequestPath
from serve_app.transport.streaming import Prepared

ENDPOINT = "embeddings"
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    served = await request.app.state.models.pick(body.model)
    return await served.embeddings.create(body)


class EmbeddingsService:
    def __init__(self, path: RequestPath) -> None:
        self.path = path
        spec = read_spec(path.args.model)
        self.config = read_embedding_config(path.args.model, spec.hidden_size)

    async def create(self, body: EmbeddingRequest) -> Response:
        path, headers = self.path, {}
        try:
            headers = path.ignored_header(body)
            try:
                self.config.check_dimensions(body.dimensions)
                prompts = self._prompts(body.input)
            except InvalidParam as exc:
                raise OpenAIError.bad_request(exc) from None
            lora = await path.adapters.resolve(body.model)
            vectors = await self._embed(prompts, lora)
        except OpenAIError as exc:
            path.metrics.answered(ENDPOINT, exc.status)
            return exc.response()
        path.metrics.answered(ENDPOINT, 200)
        shape = (body.dimensions, self.config.normalize, body.encoding_format)
        data = [
            {"object": "embedding", "index": i, "embedding": encoded(v, *shape)}
            for i, v in enumerate(vectors)
        ]
        tokens = sum(len(p) for p in prompts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        answer = {"object": "list", "data": data, "model": body.model, "usage": usage}
        return JSONResponse(answer, headers=headers)

    def _prompts(self, value: str | list) -> list[list[int]]:
        """Each input's token ids: strings tokenized as the model's tokenizer does (with its
        special tokens), token ids checked against the vocabulary."""
        if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
            value = [value]
        if not value:
            raise InvalidParam("input", "input: must not be empty")
        if len(value) > MAX_INPUTS:
            raise InvalidParam("input", f"input: at most {MAX_INPUTS} inputs per request")
        prompts, limit = [], self.path.max_model_len
        for i, item in enumerate(value):
            name = "input" if len(value) == 1 else f"input[{i}]"
            try:
                ids = self.path.prompts.completion(item)
            except InvalidParam as exc:
                raise InvalidParam(name, str(exc).replace("prompt:", f"{name}:", 1)) from None
            if not ids:
                raise InvalidParam(name, f"{name}: must not be empty")
            if len(ids) > limit:
                message = f"{name}: {len(ids)} tokens, more than max_model_len ({limit})"
                raise InvalidParam(name, message)
            prompts.append(ids)
        return prompts

    async def _embed(self, prompts: list[list[int]], lora) -> list[list[float]]:
        """The vectors of every prompt, embedded concurrently; any failure fails them all
        (each started one is cancelled, its engine request aborted)."""
        config, base = self.config, f"embd-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, pooling=config.pooling, normalize=config.normalize)
        # At most an engine replica's capacity in flight: a long list is not its own 429.
        gate = asyncio.Semaphore(self.path.args.replica_capacity)

        async def one(i: int, prompt: list[int]) -> list[float]:
            prep = Prepared(f"{base}-{i}", prompt, params, ENDPOINT, False, False, lora=lora)
            async with gate:
                (choice,) = await self.path.client.start_choices(prep, 1, None, 0)
                last: RequestOutput = choice.first
                async with contextlib.aclosing(choice.deltas) as outs:
                    async for out in outs:
                        last = out
            if last.embedding is None:
                raise OpenAIError.server_error(500, f"engine error: {last.error}")
            return last.embedding

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()


def encoded(
    vector: list[float], dimensions: int | None, normalize: bool, encoding_format: str
) -> list[float] | str:
    """A vector as the response carries it: truncated to `dimensions` (a unit vector made
    one again where embeddings are normalized), as floats or base64 little-endian float32."""
    if dimensions is not None and dimensions < len(vector):
        vector = vector[:dimensions]
        if normalize:
            norm = math.sqrt(sum(x * x for x in vector)) or 1.0
            vector = [x / norm for x in vector]
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
