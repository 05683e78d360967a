"""OpenAIIngress: the HTTP face (FastAPI through @serve.ingress).

Validates bodies (400 names the field), applies the chat template, tokenizes, and streams
each request from an engine replica through a DeploymentHandle. Engine replicas that are full
make it answer 429 with Retry-After; a client that goes away cancels the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from engine.core.outputs import RequestOutput, merge_queued
from serve_app import openai_protocol as oai
from serve_app import tracing
from serve_app.config import AppArgs
from serve_app.delta_channel import ChannelledFirst, DeltaChannels
from serve_app.engine_server import EngineRejection
from serve_app.telemetry import IngressMetrics, render_engine_metrics

logger = logging.getLogger(__name__)

app = FastAPI(title="dynabatch", description="OpenAI-compatible LLM serving")


class OpenAIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        err_type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.err_type, self.code, self.headers = err_type, code, headers

    def response(self) -> JSONResponse:
        body = oai.error_body(self.message, self.err_type, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request body"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type names to the path; keep only the field names.
    param = ".".join(p for p in loc if not p.startswith(("list[", "str", "int"))) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if first.get("type") == "extra_forbidden":
        message = f"{param}: unknown or unsupported field"
    return JSONResponse(oai.error_body(message, param=param), status_code=400)


@dataclass
class _Prepared:
    """A validated request, ready for an engine replica."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    endpoint: str
    include_usage: bool
    continuous_usage: bool
    started: float = field(default_factory=time.perf_counter)
    span: Any = None  # the request's OpenTelemetry span (tracing on)
    # Its deltas after the first, when they come through a delta channel.
    queue: asyncio.Queue[RequestOutput | BaseException] | None = None


@serve.deployment(name="OpenAIIngress")
@serve.ingress(app)
class OpenAIIngress:
    def __init__(
        self,
        engine: DeploymentHandle,
        args: dict[str, Any] | AppArgs,
        controller: DeploymentHandle | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.args = AppArgs.model_validate(args)
        self.model_name = self.args.model_name
        self.max_model_len = self.args.engine.max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(self.args.model)
        self.vocab_size = len(self.tokenizer)
        self.engine = engine.options(stream=True)
        self.channels: DeltaChannels | None = None
        if self.args.delta_channels:
            context = serve.get_replica_context()
            replica = context.replica_id.unique_id if context else "local"
            self.channels = DeltaChannels(engine, f"{replica}-{uuid.uuid4().hex[:8]}")
        self.metrics = IngressMetrics(self.model_name)
        self.created = oai.now()
        self.controller = controller
        self.tracer = tracing.make_tracer(self.args.tracing, "ingress")

    # ------------------------------------------------------------------------ endpoints
    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "dynabatch",
                    "root": self.args.model,
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics(self) -> Response:
        body = self.metrics.render()
        if self.controller is not None:
            try:
                latest = await asyncio.wait_for(
                    self.controller.latest.remote(), self.args.controller.report_timeout_s
                )
                body += render_engine_metrics(self.model_name, latest)
            except Exception as exc:  # controller restarting: the ingress's own metrics only
                logger.warning("engine metrics unavailable: %r", exc)
        return Response(body, media_type=self.metrics.content_type)

    @app.get("/v1/cluster")
    async def cluster(self) -> Response:
        """The controller's view: per replica stats, limits and decisions (cluster.status)."""
        if self.controller is None:
            return OpenAIError(
                503,
                "the cluster controller is disabled (controller.enabled)",
                err_type="server_error",
            ).response()
        try:
            view = await asyncio.wait_for(
                self.controller.status.remote(), self.args.controller.report_timeout_s
            )
        except Exception as exc:  # restarting: the view comes back with the next reports
            return OpenAIError(
                503,
                f"cluster controller unavailable: {type(exc).__name__}",
                err_type="server_error",
            ).response()
        return JSONResponse(view)

    @app.post("/v1/completions")
    async def completions(self, body: oai.CompletionRequest) -> Response:
        return await self._serve("completions", body)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oai.ChatCompletionRequest) -> Response:
        return await self._serve("chat", body)

    # ------------------------------------------------------------------------ the path
    async def _serve(
        self, endpoint: str, body: oai.CompletionRequest | oai.ChatCompletionRequest
    ) -> Response:
        stream = prepared = None
        span = self._start_span(endpoint, body)
        try:
            prepared = self._prepare(endpoint, body)
            prepared.span = span
            carrier = tracing.inject(span) if span is not None else None
            channel = None
            if self.channels is not None:
                prepared.queue = self.channels.open(prepared.request_id)
                channel = self.channels.channel_id
            stream = self.engine.generate.remote(
                prepared.request_id,
                prepared.prompt_token_ids,
                prepared.params,
                carrier,
                body.priority,
                channel,
            )
            first = await self._first(prepared, stream)
        except OpenAIError as exc:
            self._forget(prepared)
            self.metrics.answered(endpoint, exc.status)
            if span is not None:
                span.set_attribute("http.response.status_code", exc.status)
                span.end()
            return exc.response()
        except asyncio.CancelledError:  # the client left before the first token
            self._forget(prepared)
            if stream is not None:
                stream.cancel()
            if span is not None:
                span.set_attribute("dynabatch.finish_reason", "abort")
                span.end()
            raise
        if body.stream:
            self.metrics.answered(endpoint, 200)
            events = self._sse(prepared, body.model, first, stream)
            if span is not None:
                events = self._closing_span(prepared, events)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            return await self._whole(prepared, body.model, first, stream)
        finally:
            if prepared.span is not None:  # cancelled before it completed
                prepared.span.set_attribute("dynabatch.finish_reason", "abort")
                prepared.span.end()
                prepared.span = None

    def _start_span(self, endpoint: str, body: oai.CompletionRequest | oai.ChatCompletionRequest):
        if self.tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        return self.tracer.start_span(
            f"POST {path}",
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "url.path": path,
                "dynabatch.stream": bool(body.stream),
                "gen_ai.request.model": body.model,
            },
        )

    def _prepare(
        self, endpoint: str, body: oai.CompletionRequest | oai.ChatCompletionRequest
    ) -> _Prepared:
        if body.model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )
        unsupported = body.unsupported()
        if unsupported is not None:
            raise OpenAIError(400, unsupported[1], param=unsupported[0])
        try:
            if isinstance(body, oai.ChatCompletionRequest):
                prompt_ids = self._chat_prompt(body)
                requested = body.requested_max_tokens
            else:
                prompt_ids = self._completion_prompt(body.single_prompt())
                requested = body.max_tokens if body.max_tokens is not None else 16
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=oai.field_of_message(str(exc))) from None
        if not prompt_ids:
            raise OpenAIError(400, "prompt: must not be empty", param="prompt")
        room = self.max_model_len - len(prompt_ids)
        max_tokens = requested if requested is not None else room
        if max_tokens > room or room < 1:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt_ids) + max(max_tokens, 1)} tokens "
                f"({len(prompt_ids)} in the prompt, {max(max_tokens, 1)} for the completion).",
                param="messages" if endpoint == "chat" else "prompt",
                code="context_length_exceeded",
            )
        try:
            params = body.sampling_params(max_tokens)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=oai.field_of_message(str(exc))) from None
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        return _Prepared(
            oai.new_id(prefix),
            prompt_ids,
            params,
            endpoint,
            body.include_usage,
            body.continuous_usage,
        )

    def _completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        return list(prompt)

    def _chat_prompt(self, body: oai.ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises on role orders a template does not allow
            raise ValueError(f"messages: the chat template rejected them: {exc}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _forget(self, prep: _Prepared | None) -> None:
        if prep is not None and prep.queue is not None and self.channels is not None:
            self.channels.close(prep.request_id)

    async def _first(self, prep: _Prepared, stream) -> RequestOutput:
        """The engine's first delta, or the HTTP error its rejection or failure stands for."""
        try:
            first = await anext(stream)
        except BackPressureError as exc:
            raise self._overloaded(str(exc)) from None
        except StopAsyncIteration:
            raise OpenAIError(
                500, "engine ended the request without output", err_type="server_error"
            ) from None
        except Exception as exc:  # replica died or is unreachable
            logger.exception("engine call failed")
            raise OpenAIError(
                503, f"engine unavailable: {type(exc).__name__}", err_type="server_error"
            ) from None
        if isinstance(first, EngineRejection):
            if first.kind == "overloaded":
                raise self._overloaded(first.message)
            raise OpenAIError(400, first.message, param=first.param)
        if isinstance(first, ChannelledFirst):
            assert self.channels is not None
            self.channels.attach(prep.request_id, first.replica_id)
            return first.output
        self._forget(prep)  # an engine replica without channels streams on the call itself
        prep.queue = None
        return first

    def _overloaded(self, message: str) -> OpenAIError:
        return OpenAIError(
            429,
            message,
            err_type="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": str(self.args.retry_after_s)},
        )

    async def _deltas(
        self, prep: _Prepared, first: RequestOutput, stream
    ) -> AsyncIterator[RequestOutput]:
        """First delta then the rest; cancels the engine request if the consumer stops early."""
        done = False
        try:
            yield first
            done = first.finished
            if done:  # a one-token request: nothing follows on its channel
                return
            rest = (
                contextlib.nullcontext(stream)
                if prep.queue is None
                else contextlib.aclosing(self._channelled(prep, prep.queue, stream))
            )
            async with rest as later:
                async for out in later:
                    yield out
                    done = out.finished
        finally:
            if not done:
                stream.cancel()
            self._forget(prep)

    async def _channelled(
        self, prep: _Prepared, queue: asyncio.Queue[RequestOutput | BaseException], stream
    ) -> AsyncIterator[RequestOutput]:
        """A request's deltas from its delta channel; its own call is watched only for
        failures (its replica died before the channel was up)."""
        watcher = asyncio.get_running_loop().create_task(self._watch(prep, stream))
        try:
            while True:
                item = merge_queued(await queue.get(), queue)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            watcher.cancel()

    async def _watch(self, prep: _Prepared, stream) -> None:
        try:
            async for _ in stream:
                pass
        except Exception as exc:
            assert self.channels is not None
            self.channels.fail(prep.request_id, exc)

    async def _whole(self, prep: _Prepared, model: str, first: RequestOutput, stream) -> Response:
        text, last, ttft = [], first, time.perf_counter() - prep.started
        async with contextlib.aclosing(self._deltas(prep, first, stream)) as deltas:
            async for out in deltas:
                text.append(out.new_text)
                last = out
        self._record(prep, last, ttft)
        if last.finish_reason == "error":
            self.metrics.answered(prep.endpoint, 500)
            return OpenAIError(
                500, f"engine error: {last.error}", err_type="server_error"
            ).response()
        base = {"id": prep.request_id, "created": oai.now(), "model": model}
        content = "".join(text)
        if prep.endpoint == "chat":
            body = base | {
                "object": "chat.completion",
                "choices": [oai.chat_choice(content, last.finish_reason)],
            }
        else:
            body = base | {
                "object": "text_completion",
                "choices": [oai.completion_choice(content, last.finish_reason)],
            }
        body["usage"] = oai.usage(last.num_prompt_tokens, last.num_output_tokens)
        self.metrics.answered(prep.endpoint, 200)
        return JSONResponse(body)

    async def _sse(
        self, prep: _Prepared, model: str, first: RequestOutput, stream
    ) -> AsyncIterator[str]:
        chat = prep.endpoint == "chat"
        base = {
            "id": prep.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": oai.now(),
            "model": model,
        }
        if prep.include_usage:
            base["usage"] = None

        def event(choices: list[dict[str, Any]]) -> str:
            chunk = base | {"choices": choices}
            if prep.continuous_usage:  # usage so far on every chunk (vLLM's extension)
                chunk["usage"] = oai.usage(last.num_prompt_tokens, last.num_output_tokens)
            return f"data: {json.dumps(chunk)}\n\n"

        ttft = time.perf_counter() - prep.started
        last = first
        if chat:
            yield event([oai.chat_delta_choice({"role": "assistant", "content": ""}, None)])
        async with contextlib.aclosing(self._deltas(prep, first, stream)) as deltas:
            async for out in deltas:
                last = out
                if out.finish_reason == "error":
                    body = oai.error_body(f"engine error: {out.error}", "server_error")
                    yield f"data: {json.dumps(body)}\n\n"
                    break
                finish = out.finish_reason if out.finished else None
                if chat:
                    if out.new_text:
                        yield event([oai.chat_delta_choice({"content": out.new_text}, None)])
                    if finish:
                        yield event([oai.chat_delta_choice({}, finish)])
                elif out.new_text or finish:
                    yield event([oai.completion_choice(out.new_text, finish)])
        self._record(prep, last, ttft)
        if prep.include_usage and last.finish_reason != "error":
            usage = oai.usage(last.num_prompt_tokens, last.num_output_tokens)
            yield f"data: {json.dumps(base | {'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    def _record(self, prep: _Prepared, last: RequestOutput, ttft: float) -> None:
        if prep.span is not None:
            span = prep.span
            span.set_attribute("dynabatch.request_id", prep.request_id)
            span.set_attribute("http.response.status_code", 200)
            span.set_attribute("gen_ai.usage.input_tokens", last.num_prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", last.num_output_tokens)
            span.set_attribute("dynabatch.finish_reason", last.finish_reason or "abort")
            span.set_attribute("dynabatch.ttft_s", ttft)
            span.end()
            prep.span = None
        self.metrics.completed(
            last.num_prompt_tokens,
            last.num_output_tokens,
            last.finish_reason,
            ttft,
            time.perf_counter() - prep.started,
        )

    async def _closing_span(self, prep: _Prepared, events: AsyncIterator[str]):
        """The SSE events, ending the request's span even when the client leaves early."""
        try:
            async for event in events:
                yield event
        finally:
            if prep.span is not None:
                prep.span.set_attribute("dynabatch.finish_reason", "abort")
                prep.span.end()
                prep.span = None
