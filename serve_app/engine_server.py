"""EngineServer: the engine replica ("GPU actor"), one AsyncLLMEngine per replica.

Only plain data crosses its handle: prompt token ids and SamplingParams in, RequestOutput
deltas (one per engine step per request, coalesced when the caller lags) or one
EngineRejection out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ray import serve

from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from serve_app.config import AppArgs
from serve_app.openai_protocol import field_of_message

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRejection:
    """Why an engine replica did not take a request; the ingress maps it to an HTTP status."""

    kind: Literal["overloaded", "invalid_request"]
    message: str
    param: str | None = None


@serve.deployment(name="EngineServer")
class EngineServer:
    def __init__(self, args: dict[str, Any] | AppArgs) -> None:
        from engine.async_engine import AsyncLLMEngine
        from engine.llm_engine import LLMEngine

        self.args = AppArgs.model_validate(args)
        self.capacity = self.args.replica_capacity
        policy = self.args.batching.make(self.args.engine.max_num_seqs)
        config = self.args.engine.engine_config(self.args.model)
        self.engine = AsyncLLMEngine(LLMEngine(config, policy=policy))
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context else "local"
        self.num_rejected_total = 0

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput | EngineRejection]:
        if self.engine.num_streams >= self.capacity:
            self.num_rejected_total += 1
            yield EngineRejection(
                "overloaded",
                f"engine replica is full ({self.capacity} requests: max_num_seqs + "
                "max_queued_requests); retry later",
            )
            return
        try:
            stream = self.engine.generate(prompt_token_ids, params, request_id)
            first = await anext(stream)
        except ValueError as exc:  # bad input: names the field; everyone else keeps going
            yield EngineRejection("invalid_request", str(exc), field_of_message(str(exc)))
            return
        except StopAsyncIteration:
            return
        yield first
        interval = self.args.stream_interval_s
        if interval <= 0.0:
            async for out in stream:
                yield out
            return
        held: RequestOutput | None = None
        last_sent = time.monotonic()
        async for out in stream:
            held = out if held is None else held.merge(out)
            now = time.monotonic()
            if out.finished or now - last_sent >= interval:
                yield held
                held, last_sent = None, now

    async def stats(self) -> dict[str, Any]:
        """This replica's scheduler stats plus stream bookkeeping (tests, /metrics, controller)."""
        stats = asdict(self.engine.engine.stats())
        stats.update(
            replica_id=self.replica_id,
            num_streams=self.engine.num_streams,
            capacity=self.capacity,
            num_rejected_total=self.num_rejected_total,
            step_seconds_total=self.engine.step_seconds_total,
        )
        return stats

    async def model_info(self) -> dict[str, Any]:
        return {
            "max_model_len": self.engine.engine.scheduler.config.max_model_len,
            "vocab_size": self.engine.engine.runner_vocab_size(),
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """Read by the ingress's request router (serve_app.router.LoadAwareRouter)."""
        return {"num_streams": self.engine.num_streams, "capacity": self.capacity}

    async def check_health(self) -> None:
        if self.engine.loop_error is not None:
            raise RuntimeError(f"engine loop died: {self.engine.loop_error!r}")

    async def __del__(self) -> None:
        await self.engine.shutdown()
