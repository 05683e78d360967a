"""Whether Serve has begun to stop this replica (a scale-down, a redeploy, an operator's
`serve shutdown`).

Serve tells a replica's class nothing when it starts stopping it: it stops routing to it,
waits for its ongoing requests to end (up to `graceful_shutdown_timeout_s`) and only then
calls `__del__`. A replica that hands its sequences on to other replicas instead of finishing
them must know at the start, so it reads the flag Serve's own replica object sets then
(`_shutting_down`, Ray 2.58), found through the actor instance Ray's worker keeps. Where it is
not found (another Ray, or not in a replica), the answer is always False and the replica
drains as Serve's replicas do.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ray import serve
from ray.serve._private.common import RequestMetadata

logger = logging.getLogger(__name__)

_LINK_CALL = RequestMetadata(request_id="", internal_request_id="", call_method="generate")


class DrainSignal:
    def __init__(self) -> None:
        self._replica = _serve_replica()
        if self._replica is None:
            logger.warning("Serve's replica object not found: sequences finish here on a stop")
        context = serve.get_replica_context()
        self._deployment = (context.app_name, context.deployment) if context else None

    @property
    def readable(self) -> bool:
        """Whether a stop can be seen at all."""
        return self._replica is not None

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """A request that did not come through Serve (a link call) counted among Serve's
        ongoing requests while it runs: Serve's stop waits for it as for its own, and its
        routers' probes see it."""
        manager = getattr(self._replica, "_metrics_manager", None)
        if manager is None:
            yield
            return
        manager.inc_num_ongoing_requests(_LINK_CALL)
        try:
            yield
        finally:
            manager.dec_num_ongoing_requests(_LINK_CALL)

    def stopping(self) -> bool:
        return bool(self._replica is not None and getattr(self._replica, "_shutting_down", False))

    def peers_running(self) -> bool:
        """Whether another replica of this deployment runs (one a sequence moved out can go
        to; a redeploy may stop every old replica before a new one runs). Blocking: it asks
        Serve's controller."""
        if self._deployment is None:
            return False
        app, deployment = self._deployment
        try:
            status = serve.status().applications[app].deployments[deployment]
        except Exception:  # the controller restarting, the app going: ask again later
            return False
        return status.replica_states.get("RUNNING", 0) > 0  # this one is STOPPING


def _serve_replica() -> Any | None:
    """Serve's replica implementation in this actor process, or None."""
    try:
        import ray

        worker = ray._private.worker.global_worker
        actor = worker.actors.get(worker.actor_id)
    except Exception:  # not in an actor, or a Ray without these internals
        return None
    replica = getattr(actor, "_replica_impl", None)
    return replica if hasattr(replica, "_shutting_down") else None
