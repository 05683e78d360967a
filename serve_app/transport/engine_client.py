"""EngineClient: the ingress's side of a request at the engine replicas.

It starts each sequence of a request and waits for its first delta (or raises the HTTP error
that a rejection or failure stands for). A request's other sequences (`n`, `best_of`) go to
the replica that computed the first one's prompt, once it has: they find the prompt's full KV
blocks in that replica's prefix cache and share them instead of computing them again.

A sequence outlives its replica: when the replica dies mid-stream, the sequence resumes at
another one from the tokens the client already has (engine.core.request.Resume), so the
client's stream goes on with no token repeated or missing; greedy and seeded sequences give
exactly the tokens of an undisturbed run (a draw depends only on the seed and its index).
When its replica is stopping, the sequence moves the same way with its KV, so the replica it
goes to computes nothing again (serve_app/transport/moved_sequence.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from engine.core.outputs import RequestOutput
from engine.core.request import Resume
from engine.core.sampling_params import SamplingParams
from serve_app.openai.completion_bodies import Choice
from serve_app.openai.errors import OpenAIError
from serve_app.transport.delta_channel import ChannelledFirst, DeltaChannels
from serve_app.transport.delta_link import DeltaLinkLost
from serve_app.transport.direct_calls import DirectCalls
from serve_app.transport.engine_rejection import EngineRejection
from serve_app.transport.link_call import LinkCall
from serve_app.transport.moved_sequence import SequenceLeft
from serve_app.transport.streaming import Prepared, RequestStream

logger = logging.getLogger(__name__)

# Sends of a sequence pinned to a replica that reach another one, before it goes anywhere.
_PINNED_TRIES = 4
# Pauses between sends while no engine replica takes a sequence (doubling up to the last).
_RETRY_FIRST_S, _RETRY_MAX_S = 0.05, 1.0
# How a lost replica shows (its process, worker or node died); any other exception is a
# failure of the request itself, answered as an error rather than sent again.
# (A broken delta link is one too: its deltas may be lost, and the replica ends its requests.)
_REPLICA_LOST = (RayActorError, WorkerCrashedError, NodeDiedError, DeltaLinkLost)
# Resumes of one sequence, at most: a request that keeps losing replicas stops somewhere.
_MAX_RESUMES = 4


class _Elsewhere(Exception):
    """A pinned sequence reached another replica than the one it was sent to."""


@dataclasses.dataclass
class _Sequence:
    """One sequence of a request, as the engine replicas get it."""

    prep: Prepared
    request_id: str
    params: SamplingParams
    trace: dict[str, str]
    priority: int
    deadline: float  # monotonic: no replica took it by then, it fails
    num_sends: int = 0


@dataclasses.dataclass
class Started:
    """A sequence at an engine replica, its first delta in hand."""

    stream: RequestStream
    first: RequestOutput
    replica_id: str | None  # None: the replica streams on the call (no delta channels)
    at_prefill: bool = False  # at a prefill replica, which hands it on after its first token

    def cancel(self) -> None:
        self.stream.close()
        self.stream.call.cancel()


class EngineClient:
    def __init__(
        self,
        engine: DeploymentHandle,
        caller: str,  # this ingress replica's actor name, which the engine replicas watch
        channels: DeltaChannels | None,
        retry_after_s: float,
        request_timeout_s: float,
        on_resume: Callable[[], None] = lambda: None,
        prefill: DeploymentHandle | None = None,
    ) -> None:
        """`prefill`: the model's prefill pool (`disaggregation`), where every sequence
        starts; `engine` then takes each one with its KV after its first token."""
        # The method's handle, made once (a handle's attribute makes a new one each time).
        self.generate = engine.options(stream=True).generate
        links = channels.call_link if channels is not None else None
        self.direct = DirectCalls(self.generate, "generate", links)
        self.prefill_generate = self.prefill_direct = None
        if prefill is not None:
            self.prefill_generate = prefill.options(stream=True).generate
            self.prefill_direct = DirectCalls(self.prefill_generate, "generate")
        self.num_handed_on = 0  # sequences that went from a prefill replica to a decode one
        self.num_direct_calls = 0  # sends straight to a replica's actor (/metrics)
        self.num_link_calls = 0  # sends on a replica's delta link
        self.num_handle_calls = 0  # sends through Serve's handle
        self.caller = caller
        self.channels = channels
        self.retry_after_s = retry_after_s
        self.request_timeout_s = request_timeout_s
        self.on_resume = on_resume  # a sequence resumes at another replica (metrics)

    async def start_choices(
        self, prep: Prepared, count: int, trace: dict[str, str], priority: int
    ) -> list[Choice]:
        """`count` sequences of `prep` (seeded ones with seeds seed, seed + 1, ...): the first,
        then the others at its replica. Any failure cancels those already started."""
        deadline = time.monotonic() + self.request_timeout_s
        sequences = []
        for i in range(count):
            params = prep.params
            if i and params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + i)
            request_id = prep.request_id if count == 1 else f"{prep.request_id}-{i}"
            sequences.append(_Sequence(prep, request_id, params, trace, priority, deadline))
        first = await self._start(sequences[0], None)
        started = [first]
        try:
            rest = await asyncio.gather(
                *(self._start(s, first.replica_id) for s in sequences[1:]),
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
        return [
            Choice(i, s.first, self._resumable(seq, s))
            for i, (seq, s) in enumerate(zip(sequences, started, strict=True))
        ]

    async def _start(self, seq: _Sequence, replica_id: str | None) -> Started:
        for _ in range(_PINNED_TRIES if replica_id is not None else 0):
            try:
                return await self._send(seq, replica_id)
            except _Elsewhere:
                continue
        # Unpinned: correct anywhere, only without the shared prompt blocks. A replica that
        # is unreachable (dying, restarting) is tried again; a full one is the client's 429.
        return await self._send_until_taken(seq, None, retry=(503,))

    async def _resumable(self, seq: _Sequence, started: Started) -> AsyncIterator[RequestOutput]:
        """The sequence's deltas, from one replica after another while replicas die."""
        tokens: list[int] = []
        chars = 0
        lost = 0  # replicas it lost
        while True:
            kv = left = None  # a moved sequence's KV, and the call at the replica it left
            handed_on = False  # from its prefill replica, as every sequence there is
            try:
                async with contextlib.aclosing(started.stream.deltas(started.first)) as outs:
                    async for out in outs:
                        tokens += out.new_token_ids
                        chars += len(out.new_text)
                        yield out
                return
            except SequenceLeft as moved:  # prefilled, or its replica is stopping: on with its KV
                kv, left, handed_on = await moved.kv, started, started.at_prefill
                if handed_on:
                    self.num_handed_on += 1
                else:
                    logger.info(
                        "request %s moved after %d tokens (%s KV)",
                        seq.request_id,
                        len(tokens),
                        "with" if kv is not None else "without",
                    )
            except _REPLICA_LOST as exc:
                lost += 1
                if lost > _MAX_RESUMES:
                    message = f"the request lost {lost} engine replicas in a row"
                    raise OpenAIError.server_error(503, message) from None
                logger.warning(
                    "request %s lost its engine replica after %d tokens (%r): resuming",
                    seq.request_id,
                    len(tokens),
                    exc,
                )
            except Exception as exc:  # not a lost replica: this request's own failure
                logger.exception("request %s failed mid-stream", seq.request_id)
                message = f"engine error: {type(exc).__name__}"
                raise OpenAIError.server_error(500, message) from None
            if not handed_on:
                self.on_resume()
            seq.deadline = time.monotonic() + self.request_timeout_s
            seq.params = dataclasses.replace(seq.params, prompt_logprobs=None)  # sent already
            try:
                started = await self._send_until_taken(
                    seq, Resume(list(tokens), chars, kv), retry=(429, 503)
                )
            except OpenAIError as exc:
                message = (
                    f"the request's engine replica failed and no other took it within "
                    f"request_timeout_s ({self.request_timeout_s:g} s): {exc.message}"
                )
                raise OpenAIError.server_error(503, message) from None
            finally:
                if left is not None:  # the replica it left may drop the KV now
                    left.cancel()

    async def _send_until_taken(
        self, seq: _Sequence, resume: Resume | None, retry: tuple[int, ...]
    ) -> Started:
        """Send until a replica takes the sequence, retrying answers in `retry` until its
        deadline (then the last answer is raised)."""
        pause = _RETRY_FIRST_S
        while True:
            try:
                return await self._send(seq, None, resume)
            except OpenAIError as exc:
                if exc.status not in retry or time.monotonic() + pause > seq.deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, _RETRY_MAX_S)

    async def _send(
        self, seq: _Sequence, replica_id: str | None, resume: Resume | None = None
    ) -> Started:
        # A sequence sent again is a new request at the engines: its earlier send may still
        # hold its id at a replica that stopped answering.
        seq.num_sends += 1
        request_id = seq.request_id if seq.num_sends == 1 else f"{seq.request_id}~{seq.num_sends}"
        # A sequence starts at a prefill replica, where there is a prefill pool; it streams
        # its few deltas there on the call (the pool's replicas are not the channels').
        at_prefill = resume is None and self.prefill_direct is not None
        direct, generate = self.direct, self.generate
        if at_prefill:
            direct, generate = self.prefill_direct, self.prefill_generate
        channels = None if at_prefill else self.channels
        stream = RequestStream(request_id, channels)
        args = (
            request_id,
            seq.prep.prompt_token_ids,
            seq.params,
            seq.trace,
            seq.priority,
            stream.channel_id,
        )
        kwargs = {
            "replica_id": replica_id,
            "resume": resume,
            "caller": None if channels is not None else self.caller,
            "lora": seq.prep.lora,
        }
        try:
            stream.call = direct.send(request_id, *args, **kwargs)
            if isinstance(stream.call, LinkCall):
                self.num_link_calls += 1
            elif stream.call is not None:
                self.num_direct_calls += 1
            else:  # no replica known to have room: Serve's routing waits, probes, backs off
                stream.call = generate.remote(*args, **kwargs)
                self.num_handle_calls += 1
            first, at = await self._first(stream)
        except BaseException:  # an error answer, or the client left before the first token
            stream.close()
            if stream.call is not None:
                stream.call.cancel()
            raise
        return Started(stream, first, at, at_prefill)

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
        except _REPLICA_LOST as exc:  # dying, dead or unreachable: another may take it
            logger.warning("engine call failed: %r", exc)
            message = f"engine unavailable: {type(exc).__name__}"
            raise OpenAIError.server_error(503, message) from None
        except Exception as exc:  # this request's own failure at the replica
            logger.exception("engine call failed")
            message = f"engine error: {type(exc).__name__}"
            raise OpenAIError.server_error(500, message) from None
        if isinstance(first, EngineRejection):
            if first.kind == "elsewhere":
                raise _Elsewhere(first.message)
            if first.kind == "overloaded":
                raise self._overloaded(first.message)
            if first.kind == "stopping":  # another replica takes it
                raise OpenAIError.server_error(503, first.message)
            raise OpenAIError(400, first.message, param=first.param)
        if isinstance(first, ChannelledFirst):
            stream.attach(first.replica_id, first.link)
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
