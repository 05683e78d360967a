"""build_app: deploy.yaml's `import_path: serve_app:build_app`, args validated by AppArgs."""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from ray import cloudpickle
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from cluster.app_tables import AppTables, Table
from cluster.controller import ClusterController
from cluster.live_settings import fingerprint
from serve_app.config import AppArgs
from serve_app.deploy.cpu_share import RayCpus, engine_cpus, engine_replicas_that_fit
from serve_app.deployment_args import AutoscalingArgs
from serve_app.ingress.deployment import OpenAIIngress
from serve_app.observability.metrics_board import EngineMetricsBoard
from serve_app.observability.traffic_trace import TrafficTrace
from serve_app.openai.responses.store import ResponseStore
from serve_app.replica.engine_server import EngineServer
from serve_app.replica.lora_board import LoRABoard
from serve_app.transport.router import LoadAwareRouter
from serve_app.tuning_args import tuning_plan

logger = logging.getLogger(__name__)

# Serve's own limit on requests in flight at an engine replica sits above the replica's
# capacity, so the engine (not Serve's router backoff) decides when to answer 429.
_ROUTER_SLACK = 16
# The ingress is async and light: let it hold every request its engines could.
_INGRESS_MAX_ONGOING = 4096
# Serve's count of ongoing requests (its autoscaling context, its logs and dashboard) taken at
# the replicas: the ingress sends most engine calls to a replica's actor itself, past the
# handle that would otherwise count them. Both sides read it.
_REQUESTS_COUNTED_AT_REPLICAS = {"RAY_SERVE_COLLECT_AUTOSCALING_METRICS_ON_HANDLE": "0"}
# A model's prefill pool, with `disaggregation` (EngineServer replicas, prefill_only).
PREFILL_SERVER = "PrefillServer"


def build_app(args: dict[str, Any] | AppArgs) -> Application:
    """The OpenAI ingress bound to the engine replicas of each model it serves, built from
    validated AppArgs."""
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    app_args.check_sources()  # a model that cannot be fetched fails the deploy, naming it
    models = app_args.per_model()
    # The control plane's actors: no CPU of their own, on the nodes deploy.yaml says, checked
    # as often as the engine replicas (Serve's defaults leave an actor that stopped answering,
    # as one can after a network partition, in place for a minute and a half).
    control = {
        "ray_actor_options": {"num_cpus": 0, "resources": dict(app_args.controller.resources)},
        "health_check_period_s": app_args.health.check_period_s,
        "health_check_timeout_s": app_args.health.check_timeout_s,
    }
    # Engine metrics for /metrics go through their own board, not the controllers.
    tables: dict[str, object] = {"metrics": EngineMetricsBoard(app_args.controller.stale_after_s)}
    if app_args.api.stored_responses:  # the Responses API's, outliving any ingress replica
        tables["responses"] = ResponseStore(
            app_args.api.stored_responses, app_args.api.stored_response_ttl_s
        )
    if app_args.trace.enabled:  # the app's own traffic, from every ingress replica
        tables["trace"] = TrafficTrace(app_args.trace.max_rows, app_args.trace.max_age_s)
    shared = AppTables.options(**control).bind(tables)
    board = Table(shared, "metrics")
    store = Table(shared, "responses") if "responses" in tables else None
    trace = Table(shared, "trace") if "trace" in tables else None
    cpus = RayCpus.found()
    engines, controllers, lora_boards = [], [], []
    prefill_engines: list[Application | None] = []
    for model_args in models:
        named = model_args.model_name if len(models) > 1 else None
        controller = None
        if model_args.controller.enabled:
            deployed = fingerprint(model_args.model_dump())
            tuning = tuning_plan(model_args, deployed) if model_args.tuning.auto else None
            controller = ClusterController.options(
                name=deployment_name(ClusterController.name, named), **control
            ).bind(
                model_args.batching.model_dump(),
                model_args.engine.max_num_seqs,
                model_args.controller.stale_after_s,
                deployment_name(EngineServer.name, named),
                deployed,
                tuning,
                trace,
            )
        lora_board = None
        if model_args.engine.lora.enabled:  # the adapters served, for every ingress replica
            lora_board = LoRABoard.options(
                name=deployment_name(LoRABoard.name, named), **control
            ).bind(dict(model_args.engine.lora.adapters))
        engine = _engine(model_args, named, controller, board, cpus, len(models))
        engines.append(engine)
        prefill_engines.append(_prefill_engine(model_args, named, board, cpus, len(models)))
        controllers.append(controller)
        lora_boards.append(lora_board)
    ingress_res = app_args.ingress_replicas
    return OpenAIIngress.options(
        num_replicas=ingress_res.num_replicas,
        max_ongoing_requests=_INGRESS_MAX_ONGOING,
        # The clients' connections end at the ingress: its streams cannot move, so a replica
        # being removed drains until they end, however long the engines take to come up.
        graceful_shutdown_timeout_s=app_args.health.ingress_graceful_shutdown_timeout_s,
        ray_actor_options={
            "num_cpus": ingress_res.num_cpus,
            "num_gpus": ingress_res.num_gpus,
            "resources": dict(ingress_res.resources),
            # The ingress's code on the replica's own loop: under direct ingress its sends
            # then wait for the client (in Serve's thread they go to an unbounded queue), so
            # a client that stops reading shows (api.max_unsent_tokens); and one thread hop
            # less per chunk. Its handles' router on that loop too: every item of a stream
            # from an engine replica (a delta channel's step) otherwise crosses from the
            # router's thread.
            "runtime_env": {
                "env_vars": {
                    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                }
                | _REQUESTS_COUNTED_AT_REPLICAS
            },
        },
    ).bind(
        engines,
        [m.model_dump() for m in models],
        controllers,
        board,
        lora_boards,
        store,
        trace,
        prefill_engines,
    )


def deployment_name(base: str, model_name: str | None) -> str:
    """A model's deployment: `base` where the app serves one model; else `base` and the
    model's served name (characters other than letters, digits, `_`, `.` and `-` as `_`), so
    each model's deployments keep their names while models come and go."""
    if model_name is None:
        return base
    return f"{base}-{re.sub(r'[^A-Za-z0-9_.-]', '_', model_name)}"


def _prefill_engine(
    app_args: AppArgs, named: str | None, board: Table, cpus: RayCpus, num_models: int
) -> Application | None:
    """With `disaggregation`, one model's prefill pool: engine replicas of the same build
    that hand every sequence on after its first token, with their own engine knobs and
    autoscaling, no controller."""
    pool = app_args.prefill_pool()
    if pool is None:
        return None
    name = deployment_name(PREFILL_SERVER, named)
    return _engine(pool, named, None, board, cpus, num_models, name=name, prefill_only=True)


def _engine(
    app_args: AppArgs,
    named: str | None,
    controller: Application | None,
    board: Table,
    cpus: RayCpus,
    num_models: int,
    name: str | None = None,
    prefill_only: bool = False,
) -> Application:
    """One model's engine deployment (`named`: the model's name where the app serves
    several; `name`: the deployment's, EngineServer's by default)."""
    engine_share = engine_cpus(app_args, cpus, num_models)
    actor_options, placement = _engine_placement(app_args, engine_share)
    # The replica's handles (to the controller and the metrics board) route on its own loop:
    # a router thread of their own would wake for nothing most of the time, beside the engine.
    # Serve counts a replica's ongoing requests where they run, not at the ingress's handle,
    # which most calls bypass (serve_app/transport/direct_calls.py).
    engine_env = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"} | _REQUESTS_COUNTED_AT_REPLICAS
    scaling: dict[str, Any] = {"num_replicas": app_args.engine_replicas.num_replicas}
    if app_args.autoscaling is not None:
        fit = engine_replicas_that_fit(app_args, engine_share, cpus, num_models)
        deployed = fingerprint(app_args.model_dump())
        scaling = {
            "num_replicas": "auto",
            "autoscaling_config": _autoscaling_config(
                app_args.autoscaling,
                fit,
                deployed,
                "disaggregation.prefill_autoscaling" if prefill_only else "autoscaling",
            ),
        }
        # The replica reads its metrics push period from the environment at import.
        engine_env["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = str(
            app_args.autoscaling.metrics_interval_s
        )
    actor_options["runtime_env"] = {"env_vars": engine_env}
    return EngineServer.options(
        name=name or deployment_name(EngineServer.name, named),
        **scaling,
        max_ongoing_requests=app_args.replica_capacity + _ROUTER_SLACK,
        health_check_period_s=app_args.health.check_period_s,
        health_check_timeout_s=app_args.health.check_timeout_s,
        graceful_shutdown_timeout_s=app_args.health.graceful_shutdown_timeout_s,
        ray_actor_options=actor_options,
        **placement,
        request_router_config=RequestRouterConfig(
            request_router_class="serve_app.transport.router:LoadAwareRouter",
            _serialized_request_router_cls=_router_pickled(),
            request_router_kwargs=app_args.routing.model_dump()
            | {"block_size": app_args.engine.block_size},
            request_routing_stats_period_s=1.0,
        ),
    ).bind(app_args.model_dump(), controller, board, prefill_only)


@functools.cache
def _router_pickled() -> bytes:
    """The router class pickled by reference, once. Left to itself, RequestRouterConfig
    pickles it by value, registering and unregistering its module with cloudpickle around
    that, process-wide: two threads at it at once (a redeploy beside a handle taking a new
    config) fail with "not registered for pickle by value". Our module is importable
    wherever a replica runs, so by reference is enough."""
    return cloudpickle.dumps(LoadAwareRouter)


def _engine_placement(app_args: AppArgs, num_cpus: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine replica's actor options and, with tensor parallelism, its placement group:
    a bundle per rank, each a 1/N share of the replica's resources (one GPU each), packed on
    one node (STRICT_PACK), as Ray Serve LLM places vLLM's workers. The replica (rank 0)
    takes bundle 0 and starts each other rank in its own (engine/runner/rank_bundles.py)."""
    res, ranks = app_args.engine_replicas, app_args.engine.tensor_parallel_size
    share = {
        "num_cpus": num_cpus / ranks,
        "num_gpus": res.num_gpus / ranks,
        "resources": {name: amount / ranks for name, amount in res.resources.items()},
    }
    if ranks == 1:
        return share, {}
    bundle = {"CPU": share["num_cpus"], "GPU": share["num_gpus"]} | share["resources"]
    bundle = {name: amount for name, amount in bundle.items() if amount} or {"CPU": 0.01}
    bundles = [dict(bundle) for _ in range(ranks)]
    return share, {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}


def _autoscaling_config(
    scaling: AutoscalingArgs,
    fit: int | None = None,
    deployed: str = "",
    section: str = "autoscaling",
) -> dict[str, Any]:
    """Serve's autoscaling_config: our rule decides; Serve's own delays and factors are
    neutral so the rule behaves as in the simulator. `fit`: the engine replicas the cluster's
    CPUs hold (None: no bound); the replica counts stop there, not at a replica Ray could
    never place. `deployed`: the fingerprint of the model's args, whose applied settings
    the rule takes (cluster/live_settings.py). `section`: where deploy.yaml sets `scaling`."""
    most = scaling.max_replicas
    if fit is not None and fit < most:
        logger.warning(
            "%s.max_replicas %d: the cluster's CPUs hold %d engine replicas beside "
            "the ingress (their num_cpus); scaling stops there",
            section,
            most,
            fit,
        )
        most = fit
    least = min(scaling.min_replicas, most)
    return {
        "min_replicas": least,
        "max_replicas": most,
        "initial_replicas": min(scaling.initial_replicas or least, most),
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        # Deprecated in Serve 2.58 but still read: it keeps look_back_period_s's check honest
        # (the replicas push at this period through the environment variable above).
        "metrics_interval_s": scaling.metrics_interval_s,
        "look_back_period_s": scaling.look_back_period_s,
        "policy": {
            "policy_function": "cluster.autoscale:QueueDepthAutoscaler",
            "policy_kwargs": scaling.rule_config() | {"deployed": deployed},
        },
    }
