"""OpenAIIngress: the HTTP face (FastAPI through @serve.ingress).

Validates bodies (400 names the field), applies the chat template, tokenizes, and streams
each request from an engine replica through a DeploymentHandle (/v1/responses runs through
the same path: serve_app/request_path.py). Engine replicas that are full make it answer
429 with Retry-After; a client that goes away cancels the engine request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from functools import partial
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from engine.core.lora_config import LoRAConfig
from engine.model.loader import read_spec, resolve_max_model_len
from serve_app import openai_protocol as oai
from serve_app import tracing
from serve_app.config import AppArgs
from serve_app.delta_channel import DeltaChannels, channel_name
from serve_app.edge_routes import EdgeState, install_edge
from serve_app.embeddings import EmbeddingsService
from serve_app.embeddings import router as embeddings_router
from serve_app.engine_client import EngineClient
from serve_app.errors import OpenAIError, install_error_handlers
from serve_app.lora_names import AdapterNames
from serve_app.lora_routes import router as lora_router
from serve_app.prompts import PromptBuilder
from serve_app.request_path import Body, RequestPath
from serve_app.responses import sse_events, whole_body
from serve_app.responses_routes import router as responses_router
from serve_app.responses_service import ResponsesService
from serve_app.streaming import closing, runs_response
from serve_app.telemetry import IngressMetrics

logger = logging.getLogger(__name__)

app = FastAPI(title="dynabatch", description="OpenAI-compatible LLM serving")
install_error_handlers(app)
install_edge(app)
for router in (lora_router, responses_router, embeddings_router):
    app.include_router(router)


@serve.deployment(name="OpenAIIngress")
@serve.ingress(app)
class OpenAIIngress:
    def __init__(
        self,
        engine: DeploymentHandle,
        args: dict[str, Any] | AppArgs,
        controller: DeploymentHandle | None = None,
        metrics_board: DeploymentHandle | None = None,
        lora_board: DeploymentHandle | None = None,
        response_store: DeploymentHandle | None = None,
    ) -> None:
        self.args = AppArgs.model_validate(args)
        self.model_name = self.args.model_name
        # The engines resolve `auto` the same way, from the same config.json.
        spec = read_spec(self.args.model)
        self.max_model_len = resolve_max_model_len(self.args.engine.max_model_len, spec)
        self.prompts = PromptBuilder(self.args.model)
        lora = LoRAConfig(**self.args.engine.lora.model_dump())
        self.adapters = app.state.adapters = AdapterNames(self.model_name, lora, spec, lora_board)
        context = serve.get_replica_context()
        # The engine replicas watch this actor: its requests end if it dies.
        owner = context.replica_id.to_full_id_str() if context else "local"
        channels: DeltaChannels | None = None
        if self.args.delta_channels:
            channel_id = channel_name(owner, uuid.uuid4().hex[:8])
            channels = DeltaChannels(engine, channel_id, self.args.api.max_unsent_tokens)
        self.engine = engine
        self.metrics = IngressMetrics(self.model_name)
        self.client = EngineClient(
            engine,
            owner,
            channels,
            self.args.retry_after_s,
            self.args.request_timeout_s,
            self.metrics.sequence_resumed,
        )
        self.controller, self.metrics_board = controller, metrics_board
        tracer = tracing.make_tracer(self.args.tracing, "ingress")
        self.path = RequestPath(
            self.args, self.max_model_len, self.prompts, self.adapters, self.client,
            self.metrics, tracer,
        )  # fmt: skip
        app.state.responses = ResponsesService(self.path, response_store)
        app.state.embeddings = EmbeddingsService(self.path)
        # What the routes beside generation read (serve_app/edge_routes.py).
        app.state.edge = EdgeState(
            self.model_name,
            self.max_model_len,
            self.prompts,
            self.args.api,
            self.args.model,
            oai.now(),
            self.args.api.keys(),
            self.adapters,
        )

    # ------------------------------------------------------------------------ endpoints
    @app.get("/health")
    async def health(self) -> Response:
        """200 while an engine replica answers its health check; else 503 with the reason
        (for load balancers: this ingress can serve nothing then)."""
        try:
            timeout = self.args.health.check_timeout_s
            await asyncio.wait_for(self.engine.check_health.remote(), timeout)
        except Exception as exc:  # none running, all failing, or none answering in time
            reason = f"no engine replica is healthy: {type(exc).__name__}: {exc}"[:500]
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        body = self.metrics.render()
        if self.metrics_board is not None:
            try:
                timeout = self.args.controller.report_timeout_s
                body += await asyncio.wait_for(self.metrics_board.render.remote(), timeout)
            except Exception as exc:  # an engine replica restarting: the ingress's own only
                logger.warning("engine metrics unavailable: %r", exc)
        return Response(body, media_type=self.metrics.content_type)

    @app.get("/v1/cluster")
    async def cluster(self) -> Response:
        """The controller's view: per replica stats, limits and decisions (cluster.status)."""
        if self.controller is None:
            message = "the cluster controller is disabled (controller.enabled)"
            return OpenAIError.server_error(503, message).response()
        try:
            timeout = self.args.controller.report_timeout_s
            view = await asyncio.wait_for(self.controller.status.remote(), timeout)
        except Exception as exc:  # restarting: the view comes back with the next reports
            message = f"cluster controller unavailable: {type(exc).__name__}"
            return OpenAIError.server_error(503, message).response()
        return JSONResponse(view)

    @app.post("/v1/completions")
    async def completions(self, body: oai.CompletionRequest) -> Response:
        return await self._serve("completions", body)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oai.ChatCompletionRequest) -> Response:
        return await self._serve("chat", body)

    # ------------------------------------------------------------------------ the path
    async def _serve(self, endpoint: str, body: Body) -> Response:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        with contextlib.ExitStack() as scope:
            span = scope.enter_context(self.path.span(path, body.model, bool(body.stream)))
            headers = {}
            try:
                headers = self.path.ignored_header(body)
                prep = self.path.prepare(endpoint, body, await self.adapters.resolve(body.model))
                choices = await self.client.start_choices(
                    prep, body.num_sequences, span.carrier(), body.priority
                )
            except OpenAIError as exc:
                self.metrics.answered(endpoint, exc.status)
                span.set({"http.response.status_code": exc.status})
                response = exc.response()
                response.headers.update(headers)
                return response
            record = partial(self.path.record, prep, span, time.perf_counter() - prep.started)
            if body.stream:
                self.metrics.answered(endpoint, 200)
                runs_response()
                events = sse_events(prep, body.model, choices, record)
                # The response's body outlives this call: it ends the span when it ends.
                events = closing(events, scope.pop_all())
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            try:
                whole, lasts = await whole_body(prep, body.model, choices)
            except OpenAIError as exc:  # lost with its replica, and no other took it
                self.metrics.answered(endpoint, exc.status)
                return exc.response()
            record(lasts)
            failed = [last for last in lasts if last.finish_reason == "error"]
            if failed:
                self.metrics.answered(endpoint, 500)
                message = f"engine error: {failed[0].error}"
                return OpenAIError.server_error(500, message).response()
            self.metrics.answered(endpoint, 200)
            return JSONResponse(whole, headers=headers)
