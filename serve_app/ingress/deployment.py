"""OpenAIIngress: the HTTP face (FastAPI through @serve.ingress). Its replica builds what the
routes serve from (every route a router: operations, completions and chat, responses,
embeddings, LoRA adapters, the edge's models and tokenize), each request through the path
every request takes (serve_app/openai/request_path.py): bodies validated (400 names the
field), the chat template applied, tokenized, streamed from an engine replica through a
DeploymentHandle. Engine replicas that are full make it answer 429 with Retry-After; a client
that goes away cancels the engine request."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from engine.core.lora_config import LoRAConfig
from engine.model.loader import read_spec, resolve_max_model_len
from serve_app.config import AppArgs
from serve_app.ingress import ops_routes
from serve_app.ingress.edge_routes import EdgeState, install_edge
from serve_app.ingress.lora_names import AdapterNames
from serve_app.ingress.lora_routes import router as lora_router
from serve_app.ingress.ops_routes import OpsState
from serve_app.observability import replica_logs, tracing
from serve_app.observability.telemetry import IngressMetrics
from serve_app.openai import protocol as oai
from serve_app.openai.completions import CompletionsService
from serve_app.openai.embeddings import EmbeddingsService
from serve_app.openai.embeddings import router as embeddings_router
from serve_app.openai.errors import install_error_handlers
from serve_app.openai.prompts import PromptBuilder
from serve_app.openai.request_path import RequestPath
from serve_app.openai.responses.routes import router as responses_router
from serve_app.openai.responses.service import ResponsesService
from serve_app.transport.delta_channel import DeltaChannels, channel_name
from serve_app.transport.engine_client import EngineClient

logger = logging.getLogger(__name__)

app = FastAPI(title="dynabatch", description="OpenAI-compatible LLM serving")
install_error_handlers(app)
install_edge(app)
for router in (responses_router, embeddings_router, lora_router):
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
        replica_logs.into_replica_log()
        declared = AppArgs.model_validate(args)
        self.args = declared.with_local_model(weights=False)  # its tokenizer, not the weights
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
        self.metrics.watch_path(self.client)
        tracer = tracing.make_tracer(self.args.tracing, "ingress")
        self.path = RequestPath(
            self.args, self.max_model_len, self.prompts, self.adapters, self.client,
            self.metrics, tracer,
        )  # fmt: skip
        self.ops = OpsState(self.args, engine, self.metrics, metrics_board, controller)
        self.completion_service = CompletionsService(self.path)
        app.state.responses = ResponsesService(self.path, response_store)
        app.state.embeddings = EmbeddingsService(self.path)
        # What the routes beside generation read (serve_app/ingress/edge_routes.py).
        app.state.edge = EdgeState(
            self.model_name,
            self.max_model_len,
            self.prompts,
            self.args.api,
            declared.model,
            oai.now(),
            self.args.api.keys(),
            self.adapters,
            self.args.emulated_label(),
            self.path.defaults,
        )
        if self.path.defaults:
            logger.info(
                "%s: requests leaving these out sample with its generation_config.json's: %s",
                self.model_name,
                self.path.defaults,
            )

    # ---------------------------------------------------------------------- its routes
    # The class's own routes: Serve freezes a copy of `app` when it decorates the class, and
    # the routers above read the state set on `app` in __init__ (request.app.state) only
    # while the class has routes of its own (seen, not pinned down: see the notebook).
    @app.get("/health")
    async def health(self) -> Response:
        return await ops_routes.health(self.ops)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        return await ops_routes.metrics(self.ops)

    @app.get("/v1/cluster")
    async def cluster(self) -> Response:
        return await ops_routes.cluster(self.ops)

    @app.post("/v1/completions")
    async def completions(self, body: oai.CompletionRequest) -> Response:
        return await self.completion_service.serve("completions", body)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oai.ChatCompletionRequest) -> Response:
        return await self.completion_service.serve("chat", body)
