"""An engine replica's side of moving sequences with their KV (serve_app/transport/
moved_sequence.py): moving every sequence out once Serve starts stopping the replica and
another runs, and fetching the KV of a sequence moved in."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

import ray

from engine.core.outputs import RequestOutput
from engine.core.request import Resume
from serve_app.replica.drain_signal import DrainSignal
from serve_app.transport.moved_sequence import MOVED

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)

# How often a replica looks whether Serve has started stopping it.
_STOP_POLL_S = 0.1
# How often a stopping replica asks Serve whether another runs, to move its sequences to.
_PEERS_POLL_S = 0.5
# How long a replica waits for a moved sequence's KV before computing the context itself.
_KV_FETCH_TIMEOUT_S = 30.0
# How long a moved sequence's KV waits at the replica it left for the ingress to resume it.
MOVED_HOLD_S = 60.0


class SequenceMoves:
    def __init__(self, engine: AsyncLLMEngine, replica_id: str) -> None:
        self.engine = engine
        self.replica_id = replica_id
        self.drain = DrainSignal()
        self.stopping = False  # Serve is stopping this replica: it takes no new requests
        self.num_moved_out = 0  # sequences moved to other replicas as this one stopped
        self.num_moved_in = 0  # sequences that came with their KV's reference
        self.num_kv_fetch_failures = 0  # of which the KV could not be fetched

    def stats(self) -> dict[str, object]:
        engine = self.engine.engine
        return {
            "stopping": self.stopping,
            "num_moved_out": self.num_moved_out,
            "num_moved_in": self.num_moved_in,
            "num_kv_carried": engine.num_kv_carried,
            "num_kv_tokens_carried": engine.num_kv_tokens_carried,
            "num_kv_refused": engine.num_kv_refused,
            "num_kv_fetch_failures": self.num_kv_fetch_failures,
        }

    async def move_on_stop(self) -> None:
        """Once Serve starts stopping this replica, move every sequence it holds out: the
        ingress resumes each elsewhere with its KV, and the replica is gone once they took
        them. Until another replica runs (a redeploy), the sequences go on here."""
        while not self.drain.stopping():
            await asyncio.sleep(_STOP_POLL_S)
        self.stopping = True
        while not await asyncio.to_thread(self.drain.peers_running):
            await asyncio.sleep(_PEERS_POLL_S)
        logger.info("replica %s is stopping: moving its sequences out", self.replica_id)
        while True:  # requests still on their way in join the next move
            self.num_moved_out += await self.engine.move_out()
            await asyncio.sleep(_STOP_POLL_S)

    async def with_kv(self, resume: Resume | None) -> Resume | None:
        """A moved sequence's Resume with its KV fetched from the replica it left (the
        ingress passes the KV's ObjectRef); without it where that fails (the replica died:
        the context is computed here)."""
        if resume is None or not isinstance(resume.kv, ray.ObjectRef):
            return resume
        self.num_moved_in += 1
        try:
            kv = await asyncio.wait_for(resume.kv, _KV_FETCH_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.num_kv_fetch_failures += 1
            logger.warning("a moved sequence's KV could not be fetched (%r): computing it", exc)
            kv = None
        return dataclasses.replace(resume, kv=kv)

    @staticmethod
    async def put(kv: object) -> ray.ObjectRef:
        """A moved sequence's KV into Ray's object store (off the event loop: it copies)."""
        return await asyncio.to_thread(ray.put, kv)


def moved_delta(held: RequestOutput | None, last: RequestOutput) -> RequestOutput:
    """A moved request's last delta here: the tokens not sent yet (if any), ending "moved"."""
    if held is None:
        held = dataclasses.replace(last, new_token_ids=[], new_text="", logprobs=None)
    held = dataclasses.replace(held, prompt_logprobs=None, embedding=None)
    return dataclasses.replace(held, finished=True, finish_reason=MOVED)
