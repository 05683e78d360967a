"""EngineClient: the ingress's side of a request at the engine replicas. It starts each
sequence of a request, waits for its first delta (or raises the HTTP error that a rejection
or failure stands for), and sends a request's other sequences (`n`, `best_of`) to the replica
that computed the first one's prompt, once it has: they find the prompt's full KV blocks in
that replica's prefix cache, and share them, instead of computing them again."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from serve_app.delta_channel import ChannelledFirst, DeltaChannels
from serve_app.engine_server import EngineRejection
from serve_app.errors import OpenAIError
from serve_app.responses import Choice
from serve_app.streaming import Prepared, RequestStream

logger = logging.getLogger(__name__)

# Sends of a sequence pinned to a replica that reach another one, before it goes anywhere.
_PINNED_TRIES = 4


class _Elsewhere(Exception):
    """A pinned sequence reached another replica than the one it was sent to."""


@dataclasses.dataclass
class Started:
    """A sequence at an engine replica, its first delta in hand."""

    stream: RequestStream
    first: RequestOutput
    replica_id: str | None  # None: the replica streams on the call (no delta channels)

    def cancel(self) -> None:
        self.stream.close()
        self.stream.call.cancel()


class EngineClient:
    def __init__(
        self, engine: DeploymentHandle, channels: DeltaChannels | None, retry_after_s: float
    ) -> None:
        self.engine = engine.options(stream=True)
        self.channels = channels
        self.retry_after_s = retry_after_s

    async def start_choices(
        self, prep: Prepared, count: int, trace: dict[str, str], priority: int
    ) -> list[Choice]:
        """`count` sequences of `prep` (seeded ones with seeds seed, seed + 1, ...): the first,
        then the others at its replica. Any failure cancels those already started."""
        first = await self._start_sequence(prep, 0, count, trace, priority, None)
        started = [first]
        try:
            rest = await asyncio.gather(
                *(
                    self._start_sequence(prep, i, count, trace, priority, first.replica_id)
                    for i in range(1, count)
                ),
                return_exceptions=True,
            )
            started += [s for s in rest if isinstance(s, Started)]
            for outcome in rest:
                if isinstance(outcome, BaseException):
                    raise outcome
        except BaseException:
            for s in started:
                s.cancel()
            raise
        return [Choice(i, s.first, s.stream.deltas(s.first)) for i, s in enumerate(started)]

    async def _start_sequence(
        self,
        prep: Prepared,
        index: int,
        count: int,
        trace: dict[str, str],
        priority: int,
        replica_id: str | None,
    ) -> Started:
        request_id = prep.request_id if count == 1 else f"{prep.request_id}-{index}"
        params = prep.params
        if index and params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        for _ in range(_PINNED_TRIES if replica_id is not None else 0):
            try:
                return await self._send(request_id, prep, params, trace, priority, replica_id)
            except _Elsewhere:
                continue
        # Unpinned: correct anywhere, only without the shared prompt blocks.
        return await self._send(request_id, prep, params, trace, priority, None)

    async def _send(
        self,
        request_id: str,
        prep: Prepared,
        params: SamplingParams,
        trace: dict[str, str],
        priority: int,
        replica_id: str | None,
    ) -> Started:
        stream = RequestStream(request_id, self.channels)
        try:
            stream.call = self.engine.generate.remote(
                request_id,
                prep.prompt_token_ids,
                params,
                trace,
                priority,
                stream.channel_id,
                replica_id=replica_id,
            )
            first, at = await self._first(stream)
        except BaseException:  # an error answer, or the client left before the first token
            stream.close()
            if stream.call is not None:
                stream.call.cancel()
            raise
        return Started(stream, first, at)

    async def _first(self, stream: RequestStream) -> tuple[RequestOutput, str | None]:
        """The engine's first delta and the replica streaming the rest on a channel, or the
        HTTP error its rejection or failure stands for."""
        try:
            first = await anext(stream.call)
        except BackPressureError as exc:
            raise self._overloaded(str(exc)) from None
        except StopAsyncIteration:
            message = "engine ended the request without output"
            raise OpenAIError.server_error(500, message) from None
        except Exception as exc:  # replica died or is unreachable
            logger.exception("engine call failed")
            message = f"engine unavailable: {type(exc).__name__}"
            raise OpenAIError.server_error(503, message) from None
        if isinstance(first, EngineRejection):
            if first.kind == "elsewhere":
                raise _Elsewhere(first.message)
            if first.kind == "overloaded":
                raise self._overloaded(first.message)
            raise OpenAIError(400, first.message, param=first.param)
        if isinstance(first, ChannelledFirst):
            stream.attach(first.replica_id)
            return first.output, first.replica_id
        stream.on_call()  # an engine replica without channels streams on the call itself
        return first, None

    def _overloaded(self, message: str) -> OpenAIError:
        return OpenAIError(
            429,
            message,
            err_type="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": str(self.retry_after_s)},
        )
