"""What the ingress's operations routes answer: GET /health (for load balancers), /metrics
(Prometheus: the ingress's own and the engine replicas'), /v1/cluster (the controller's
view). The routes are the OpenAIIngress class's own (serve_app/ingress/deployment.py)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppArgs
from serve_app.observability.telemetry import IngressMetrics
from serve_app.openai.errors import OpenAIError

logger = logging.getLogger(__name__)


@dataclass
class OpsState:
    args: AppArgs
    engine: DeploymentHandle
    metrics: IngressMetrics
    metrics_board: DeploymentHandle | None
    controller: DeploymentHandle | None


async def health(ops: OpsState) -> Response:
    """200 while an engine replica answers its health check; else 503 with the reason (for
    load balancers: this ingress can serve nothing then)."""
    try:
        timeout = ops.args.health.check_timeout_s
        await asyncio.wait_for(ops.engine.check_health.remote(), timeout)
    except Exception as exc:  # none running, all failing, or none answering in time
        reason = f"no engine replica is healthy: {type(exc).__name__}: {exc}"[:500]
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(ops: OpsState) -> Response:
    body = ops.metrics.render()
    if ops.metrics_board is not None:
        try:
            timeout = ops.args.controller.report_timeout_s
            body += await asyncio.wait_for(ops.metrics_board.render.remote(), timeout)
        except Exception as exc:  # an engine replica restarting: the ingress's own only
            logger.warning("engine metrics unavailable: %r", exc)
    return Response(body, media_type=ops.metrics.content_type)


async def cluster(ops: OpsState) -> Response:
    """The controller's view: per replica stats, limits and decisions (cluster.status)."""
    if ops.controller is None:
        message = "the cluster controller is disabled (controller.enabled)"
        return OpenAIError.server_error(503, message).response()
    try:
        timeout = ops.args.controller.report_timeout_s
        view = await asyncio.wait_for(ops.controller.status.remote(), timeout)
    except Exception as exc:  # restarting: the view comes back with the next reports
        message = f"cluster controller unavailable: {type(exc).__name__}"
        return OpenAIError.server_error(503, message).response()
    return JSONResponse(view)
