"""OpenAIIngress: the HTTP face (FastAPI through @serve.ingress) of every model an app serves.
Its replica builds what the routes serve from (every route a router: operations, completions
and chat, responses, embeddings, LoRA adapters, the edge's models and tokenize), each request
to the model its `model` names (serve_app/ingress/served_models.py), through the path
every request takes (serve_app/openai/request_path.py): bodies validated (400 names the
field), the chat template applied, tokenized, streamed from an engine replica through a
DeploymentHandle. Engine replicas that are full make it answer 429 with Retry-After; a client
that goes away cancels the engine request. Batching and autoscaling settings change live
through /v1/cluster/settings (serve_app/ingress/settings_routes.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.app_tables import Table
from serve_app.config import AppArgs
from serve_app.ingress import ops_routes
from serve_app.ingress.edge_routes import EdgeState, install_edge
from serve_app.ingress.generation_routes import GenerationRoutes
from serve_app.ingress.lora_routes import router as lora_router
from serve_app.ingress.ops_routes import OpsState
from serve_app.ingress.served_models import ServedModel, ServedModels
from serve_app.ingress.settings_routes import ModelSettings
from serve_app.ingress.settings_routes import router as settings_router
from serve_app.observability import replica_logs, tracing
from serve_app.observability.telemetry import IngressMetrics
from serve_app.observability.trace_recorder import TraceRecorder
from serve_app.openai import protocol as oai
from serve_app.openai.embeddings import router as embeddings_router
from serve_app.openai.errors import install_error_handlers
from serve_app.openai.responses.routes import router as responses_router

app = FastAPI(title="dynabatch", description="OpenAI-compatible LLM serving")
install_error_handlers(app)
app.add_middleware(GenerationRoutes)  # inside the edge's checks (the later one is outer)
install_edge(app)
for router in (responses_router, embeddings_router, lora_router, settings_router):
    app.include_router(router)


@serve.deployment(name="OpenAIIngress")
@serve.ingress(app)
class OpenAIIngress:
    def __init__(
        self,
        engines: list[DeploymentHandle],
        models: list[dict[str, Any]],
        controllers: list[DeploymentHandle | None],
        metrics_board: Table | None,
        lora_boards: list[DeploymentHandle | None],
        response_store: Table | None = None,
        traffic_trace: Table | None = None,
        prefill_engines: list[DeploymentHandle | None] | None = None,
    ) -> None:
        """One engine deployment, args, controller, LoRA board and prefill pool (with
        `disaggregation`, else None) per model served (the app-wide fields of the args are
        the same in each)."""
        replica_logs.into_replica_log()
        declared = [AppArgs.model_validate(args) for args in models]
        first = declared[0]
        context = serve.get_replica_context()
        # The engine replicas watch this actor: its requests end if it dies.
        owner = context.replica_id.to_full_id_str() if context else "local"
        self.metrics = IngressMetrics()
        tracer = tracing.make_tracer(first.tracing, "ingress")
        created = oai.now()
        recorder = None
        if traffic_trace is not None:
            recorder = TraceRecorder(traffic_trace, first.trace.flush_s)
        served = [
            ServedModel.started(
                args,
                engine,
                controller,
                board,
                response_store,
                owner,
                self.metrics,
                tracer,
                created,
                recorder,
                prefill,
            )
            for args, engine, controller, board, prefill in zip(
                declared,
                engines,
                controllers,
                lora_boards,
                prefill_engines or [None] * len(engines),
                strict=True,
            )
        ]
        self.models = app.state.models = ServedModels(served)
        self.ops = OpsState(
            self.models,
            self.metrics,
            metrics_board,
            first.health,
            first.controller.report_timeout_s,
            recorder,
        )
        app_name = context.app_name if context else ""
        app.state.settings = [
            ModelSettings.of(model.name, args, dump, app_name, engine, controller)
            for model, args, dump, engine, controller in zip(
                served, declared, models, engines, controllers, strict=True
            )
        ]
        # What the routes beside generation read (serve_app/ingress/edge_routes.py).
        app.state.edge = EdgeState(first.api, self.models, first.api.keys())

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

    @app.get("/v1/cluster/trace")
    async def cluster_trace(self, since: str | None = None, until: str | None = None) -> Response:
        return await ops_routes.trace(self.ops, since, until)

    # A JSON body never reaches these two: GenerationRoutes answers it before the router (the
    # same service); they take other content types and describe the routes in /openapi.json.
    @app.post("/v1/completions")
    async def completions(self, body: oai.CompletionRequest) -> Response:
        served = await self.models.pick(body.model)
        return await served.completions.serve("completions", body)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oai.ChatCompletionRequest) -> Response:
        served = await self.models.pick(body.model)
        return await served.completions.serve("chat", body)
