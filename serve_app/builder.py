"""build_app: deploy.yaml's `import_path: serve_app:build_app`, args validated by AppArgs."""

from __future__ import annotations

from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from serve_app.config import AppArgs
from serve_app.engine_server import EngineServer
from serve_app.ingress import OpenAIIngress

# Serve's own limit on requests in flight at an engine replica sits above the replica's
# capacity, so the engine (not Serve's router backoff) decides when to answer 429.
_ROUTER_SLACK = 16
# The ingress is async and light: let it hold every request its engines could.
_INGRESS_MAX_ONGOING = 4096


def build_app(args: dict[str, Any] | AppArgs) -> Application:
    """The OpenAI ingress bound to its engine replicas, built from validated AppArgs."""
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    plain = app_args.model_dump()
    engine_res = app_args.engine_replicas
    engine = EngineServer.options(
        num_replicas=engine_res.num_replicas,
        max_ongoing_requests=app_args.replica_capacity + _ROUTER_SLACK,
        ray_actor_options={"num_cpus": engine_res.num_cpus, "num_gpus": engine_res.num_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class="serve_app.router:LoadAwareRouter",
            request_router_kwargs=app_args.routing.model_dump(),
            request_routing_stats_period_s=1.0,
        ),
    ).bind(plain)
    ingress_res = app_args.ingress_replicas
    return OpenAIIngress.options(
        num_replicas=ingress_res.num_replicas,
        max_ongoing_requests=_INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": ingress_res.num_cpus, "num_gpus": ingress_res.num_gpus},
    ).bind(engine, plain)
