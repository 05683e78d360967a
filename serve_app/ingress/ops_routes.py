"""What the ingress's operations routes answer: GET /health (for load balancers), /metrics
(Prometheus: the ingress's own and the engine replicas'), /v1/cluster (the controllers'
views), /v1/cluster/trace (the app's traffic, as the tuner's JSONL). The routes are the
OpenAIIngress class's own (serve_app/ingress/deployment.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

from cluster.app_tables import Table
from serve_app.ingress.served_models import ServedModel, ServedModels
from serve_app.observability import tuning_metrics
from serve_app.observability.telemetry import IngressMetrics
from serve_app.observability.trace_recorder import TraceRecorder
from serve_app.observability.traffic_trace import parse_instant, trace_lines
from serve_app.openai.errors import OpenAIError
from serve_app.replica.health import HealthArgs

logger = logging.getLogger(__name__)

# A day of a busy app's rows is megabytes: longer than a controller's report may take.
_TRACE_TIMEOUT_S = 60.0


@dataclass
class OpsState:
    models: ServedModels
    metrics: IngressMetrics
    metrics_board: Table | None
    health: HealthArgs
    report_timeout_s: float  # controller.report_timeout_s
    trace: TraceRecorder | None = None  # the app's traffic trace (deploy.yaml `trace:`)


async def health(ops: OpsState) -> Response:
    """200 while every model has an engine replica that answers its health check (and one
    of its prefill pool, where it has one); else 503 naming the models without one (for
    load balancers: this ingress cannot serve them)."""

    async def reason(served: ServedModel) -> str | None:
        pools = {"engine replica": served.engine, "prefill replica": served.prefill}
        for pool, handle in pools.items():
            if handle is None:
                continue
            try:
                await asyncio.wait_for(handle.check_health.remote(), ops.health.check_timeout_s)
            except Exception as exc:  # none running, all failing, or none answering in time
                return f"no {pool} is healthy: {type(exc).__name__}: {exc}"[:500]
        return None

    models = ops.models.all
    reasons = await asyncio.gather(*(reason(served) for served in models))
    failing = {served.name: why for served, why in zip(models, reasons, strict=True) if why}
    if not failing:
        return JSONResponse({"status": "ok"})
    body: dict[str, Any] = {"status": "unhealthy"}
    if len(models) == 1:
        body["reason"] = reasons[0]
    else:
        body["reason"] = "; ".join(f"{name}: {why}" for name, why in failing.items())
        body["models"] = {served.name: failing.get(served.name, "ok") for served in models}
    return JSONResponse(body, status_code=503)


async def metrics(ops: OpsState) -> Response:
    body = ops.metrics.render()
    if ops.metrics_board is not None:
        try:
            body += await asyncio.wait_for(ops.metrics_board.render.remote(), ops.report_timeout_s)
        except Exception as exc:  # an engine replica restarting: the ingress's own only
            logger.warning("engine metrics unavailable: %r", exc)
    views = {}
    for served in ops.models.all:
        if served.controller is None or not served.args.tuning.auto:
            continue
        try:
            call = served.controller.tuning_view.remote()
            views[served.name] = await asyncio.wait_for(call, ops.report_timeout_s)
        except Exception as exc:  # restarting: its figures come back with it
            logger.warning("self-tuning figures of %s unavailable: %r", served.name, exc)
    body += tuning_metrics.render({k: v for k, v in views.items() if v is not None})
    return Response(body, media_type=ops.metrics.content_type)


async def cluster(ops: OpsState) -> Response:
    """The controller's view: per replica stats, limits and decisions (cluster.status); with
    several models, each model's under `models`."""
    views = {}
    for served in ops.models.all:
        if served.controller is None:
            message = "the cluster controller is disabled (controller.enabled)"
            return OpenAIError.server_error(503, message).response()
        try:
            call = served.controller.status.remote()
            views[served.name] = await asyncio.wait_for(call, ops.report_timeout_s)
        except Exception as exc:  # restarting: the view comes back with the next reports
            message = f"cluster controller of {served.name} unavailable: {type(exc).__name__}"
            return OpenAIError.server_error(503, message).response()
    if len(views) == 1:
        return JSONResponse(views[ops.models.first.name])
    return JSONResponse({"models": views})


async def trace(ops: OpsState, since: str | None, until: str | None) -> Response:
    """The traffic trace's rows that arrived in [since, until) (each wall-clock seconds or a
    span before now such as 24h; by default all of them) as JSONL; a bad bound is a 400
    naming it."""
    if ops.trace is None:
        message = "the traffic trace is disabled (trace.enabled)"
        return OpenAIError.server_error(503, message).response()
    now = time.time()
    bounds = []
    for name, text, default in (("since", since, 0.0), ("until", until, math.inf)):
        try:
            bounds.append(default if text is None else parse_instant(text, now))
        except ValueError as exc:
            return OpenAIError(400, f"{name}: {exc}", param=name).response()
    if bounds[1] < bounds[0]:
        return OpenAIError(400, "until: before since", param="until").response()
    try:
        rows = await asyncio.wait_for(ops.trace.rows(*bounds), _TRACE_TIMEOUT_S)
    except Exception as exc:  # restarting: the rows wait at the ingress replicas meanwhile
        message = f"traffic trace unavailable: {type(exc).__name__}"
        return OpenAIError.server_error(503, message).response()
    return Response("".join(trace_lines(rows)), media_type="application/x-ndjson")
