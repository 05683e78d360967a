"""An engine replica's side of moving sequences with their KV (serve_app/transport/
moved_sequence.py): moving every sequence out once Serve starts stopping the replica and
another runs, sending a moved sequence's KV (`kv_transport`: offered on the replica's
KVLink, or put in Ray's object store), and fetching the KV of a sequence moved in."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

import ray
import torch

from engine.core.outputs import RequestOutput
from engine.core.request import Resume
from engine.core.sequence_kv import SequenceKV
from engine.runner.kv_link import KVLink, KVOffer
from engine.runner.kv_transfer import on_host
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
    def __init__(self, engine: AsyncLLMEngine, replica_id: str, transport: str) -> None:
        """`transport`: how a moved sequence's KV leaves ("link", "object_store", or "auto":
        the link from a GPU's cache); what comes in is taken either way."""
        self.engine = engine
        self.replica_id = replica_id
        self.transport = transport
        self.link = KVLink(ray.util.get_node_ip_address(), replica_id)
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
            "num_kv_offers_held": self.link.num_offers,
            "kv_link_sent": dict(self.link.num_sent),
            "kv_link_taken": dict(self.link.num_taken),
            "num_kv_link_p2p_failures": self.link.num_p2p_failures,
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
        ingress passes the KV's offer or ObjectRef); without it where that fails (the
        replica died: the context is computed here)."""
        if resume is None or resume.kv is None:
            return resume
        self.num_moved_in += 1
        if not isinstance(resume.kv, KVOffer | ray.ObjectRef):  # plain (an emulated engine's)
            return resume
        try:
            if isinstance(resume.kv, KVOffer):
                device = getattr(self.engine.engine.runner, "device", torch.device("cpu"))
                fetched = asyncio.to_thread(self.link.fetch, resume.kv, device)
            else:
                fetched = resume.kv
            kv = await asyncio.wait_for(fetched, _KV_FETCH_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.num_kv_fetch_failures += 1
            logger.warning("a moved sequence's KV could not be fetched (%r): computing it", exc)
            kv = None
        return dataclasses.replace(resume, kv=kv)

    async def send(
        self, kv: SequenceKV, plain: bool = False
    ) -> KVOffer | ray.ObjectRef | SequenceKV:
        """What the ingress passes on to the replica where the sequence goes on: the KV's
        offer on this replica's link, or its ObjectRef (a copy on the host in Ray's object
        store; off the event loop); KV without bytes (an emulated engine's) as it is.
        `plain`: the offer, whatever the transport (the answer goes on a delta link, where
        only plain data crosses: Ray does not track an ObjectRef sent there)."""
        if kv.data is None:
            return kv
        on_gpu = getattr(kv.data, "is_cuda", False)
        if plain or self.transport == "link" or (self.transport == "auto" and on_gpu):
            return self.link.offer(kv)
        return await asyncio.to_thread(lambda: ray.put(on_host(kv)))

    def sent(self, sent: object) -> None:
        """The sequence has gone on elsewhere (or will not): its KV may go."""
        if isinstance(sent, KVOffer):
            self.link.withdraw(sent)


def moved_delta(held: RequestOutput | None, last: RequestOutput) -> RequestOutput:
    """A moved request's last delta here: the tokens not sent yet (if any), ending "moved"."""
    if held is None:
        held = dataclasses.replace(last, new_token_ids=[], new_text="", logprobs=None)
    held = dataclasses.replace(held, prompt_logprobs=None, embedding=None)
    return dataclasses.replace(held, finished=True, finish_reason=MOVED)
