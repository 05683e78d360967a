"""DirectCalls: an engine call sent to the chosen engine replica's actor by the ingress itself.

Through Serve's handle a request costs the ingress about twice the CPU of a plain actor call
(reports/notebook.md): the handle's request metadata and counters, a routing task and its
future, the replica's extra stream item that says it accepted, the handle's own autoscaling
metrics (our autoscaling reads the replicas' own). Here the same router instance Serve runs
for the handle (serve_app.transport.router.LoadAwareRouter, with Serve's list of running
replicas and its queue-length cache) picks the replica, and the call goes to the replica's
Serve entry point (`handle_request_streaming`) as Serve's own router sends it, so the replica
counts, limits and cancels it as any other. What the handle does beside that is done here as
Serve does it: the queue-length cache counts the call while it runs, and a replica whose actor
died is dropped from the router's list at once.

Where the ingress holds a delta link to the chosen replica that takes engine calls, the call
goes on it instead (serve_app.transport.link_call), counted in the cache the same way.

Only the easy case goes direct: a replica known to have room. While Serve's router has no
replicas yet, or none with room by its cache, `send` returns None and the caller uses the
handle, whose routing waits, probes and backs off. (Our engine replicas answer a full replica's
call with an EngineRejection, never by holding it, so the handle's rejection protocol is not
needed on the direct path.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve._private.common import RequestMetadata
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RunningReplica

from serve_app.transport.delta_link import LinkReader
from serve_app.transport.link_call import LinkCall
from serve_app.transport.router import LoadAwareRouter

logger = logging.getLogger(__name__)


class DirectCall:
    """One call's stream of items (as a handle call's: `anext`, `async for`, `cancel`)."""

    def __init__(self, result: Any) -> None:
        self._result = result  # Serve's ActorReplicaResult

    def __aiter__(self) -> DirectCall:
        return self

    async def __anext__(self) -> Any:
        return await self._result.__anext__()

    def cancel(self) -> None:
        self._result.cancel()


class DirectCalls:
    def __init__(
        self,
        handle: DeploymentHandle,
        method: str,
        links: Callable[[str], LinkReader | None] | None = None,
    ) -> None:
        """`handle`: the engine deployment's streaming handle (its router is the one used).
        `links(replica_id)`: the delta link to that replica that takes engine calls, if
        one is open: a call goes there rather than as a Ray actor call."""
        self.handle = handle
        self.links = links
        self._metadata = RequestMetadata(
            request_id="",
            internal_request_id="",
            call_method=method,
            app_name=handle.app_name,
            is_streaming=True,
            _on_separate_loop=False,
        )

    def send(self, request_id: str, *args: Any, **kwargs: Any) -> DirectCall | LinkCall | None:
        """The call, sent to the replica the router picks (on its delta link, where one is
        open); None when it cannot go direct."""
        router = self._router()
        replica = router.pick(args, kwargs) if router is not None else None
        if router is None or replica is None:
            return None
        link = None
        if self.links is not None and _plain(kwargs):
            link = self.links(replica.replica_id.unique_id)
        if link is not None:
            router.on_send_request(replica.replica_id)
            ended = functools.partial(router.decrement_queue_len_cache, replica.replica_id)
            return link.call(request_id, args, kwargs, on_end=ended)
        metadata = dataclasses.replace(
            self._metadata, request_id=request_id, internal_request_id=request_id
        )
        pending = PendingRequest(args=list(args), kwargs=kwargs, metadata=metadata)
        result = replica.try_send_request(pending, with_rejection=False)
        router.on_send_request(replica.replica_id)
        loop = asyncio.get_running_loop()
        # Ray runs a result's callbacks on one of its own threads.
        result.add_done_callback(
            lambda outcome: loop.call_soon_threadsafe(self._ended, router, replica, outcome)
        )
        return DirectCall(result)

    def _router(self) -> LoadAwareRouter | None:
        """The handle's request router, once Serve has made it (when the deployment's config
        has reached the handle). Serve makes it from its own by-value pickle of the class, so
        it is recognised by its method, not by isinstance."""
        wrapper = getattr(self.handle, "_router", None)
        router = getattr(wrapper, "_asyncio_router", None)
        request_router = getattr(router, "request_router", None) if router is not None else None
        return request_router if hasattr(request_router, "pick") else None

    @staticmethod
    def _ended(router: LoadAwareRouter, replica: RunningReplica, outcome: Any) -> None:
        router.decrement_queue_len_cache(replica.replica_id)
        if isinstance(outcome, ActorDiedError):
            died = getattr(outcome, "actor_id", None)
            if died is None or died == replica.actor_id.hex():
                logger.warning("%s died: no more calls go there", replica.replica_id)
                router.on_replica_actor_died(replica.replica_id)
        elif isinstance(outcome, ActorUnavailableError):
            router.on_replica_actor_unavailable(replica.replica_id)


def _plain(kwargs: dict[str, Any]) -> bool:
    """Whether a call's arguments may cross a link: a resumed sequence's KV in Ray's object
    store goes by Ray, which tracks who holds its reference."""
    resume = kwargs.get("resume")
    return resume is None or not isinstance(resume.kv, ray.ObjectRef)
