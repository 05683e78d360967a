"""LoadAwareRouter: least-loaded engine replica, with optional prompt-prefix affinity or
KV-aware routing (serve_app/transport/cached_prefix.py).

Load is a replica's outstanding requests (queued + running): Serve's queue-length cache,
which the router updates on every send and every probe, falling back to the replica's own
`record_routing_stats()`; divided by the routing weight the cluster controller gives the
replica (below 1 when its latency is over the deployment's SLA target). Prefix affinity uses
rendezvous hashing of the first `prefix_tokens` prompt tokens over replica ids
(cluster/prefix_routing.py, which the simulator applies too). With `kv_aware` instead, a
request goes to the replica whose load less `kv_weight` times the share of the prompt's full
blocks its prefix cache holds, plus `kv_weight` times the share of its cache that cached
blocks fill, is lowest; a prefix that as many prompts continued differently as there are
replicas counts as held by all (cluster/shared_prefixes.py). The replicas publish their
blocks' keys and that share in their routing stats every second; the keys of the prompts sent
to a replica count as held there for a few seconds before it does. A request with a LoRA adapter
goes first to the least loaded replica that holds the adapter in a slot (its
`record_routing_stats()` lists them), unless that one is busier than the least loaded by over
`max_imbalance`; elsewhere the replica loads it. A sequence that comes with its KV (moved
from a stopping replica, or handed on by a prefill replica) goes to the least loaded replica
whose free KV blocks (in its routing stats) hold its context, before any that cannot: there it
is imported at once instead of waiting for blocks, or preempting others to get them.

A call with a `replica_id` keyword (an ingress subscribing to its delta channel at one engine
replica, serve_app.transport.delta_channel) goes to that replica while this router knows
it, and to any replica otherwise (which answers that it is not the one asked for). Serve's
FIFOMixin hands a choice to the oldest waiting request; here a choice goes to the request it
was made for (its prefix, its target) while that one still waits, and only otherwise to the
oldest.
(Serve's non-FIFO mode drops such choices instead, and with many requests waiting its
routing tasks flooded busy replicas with queue-length probes here.)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ray.serve._private.common import RequestMetadata  # the type of a public hook's argument
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from cluster.control import weighted_load
from cluster.prefix_routing import affinity_ranked, kv_ranked, prefix_key
from cluster.shared_prefixes import SharedPrefixes
from engine.core.block_hashes import prompt_block_hashes
from serve_app.transport.cached_prefix import Holding, PublishedBlocks

R = TypeVar("R")


class LoadAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(
        self,
        *,
        prefix_affinity: bool,
        prefix_tokens: int,
        max_imbalance: int,
        kv_aware: bool = False,
        kv_weight: float = 0.0,
        block_size: int = 16,
    ) -> None:
        """Serve passes deploy.yaml's `routing:` (serve_app.config.RoutingArgs) and the
        engine's KV block size."""
        self.prefix_affinity = prefix_affinity
        self.prefix_tokens = prefix_tokens
        self.max_imbalance = max_imbalance
        self.kv_aware = kv_aware
        self.kv_weight = kv_weight
        self.block_size = block_size
        self.published = PublishedBlocks()
        self.shared = SharedPrefixes()

    def _get_pending_request_matching_metadata(
        self, request_metadata: RequestMetadata | None = None
    ) -> PendingRequest | None:
        return self._get_pending_request_matching_internal_request_id(request_metadata)

    def replica_load(self, replica: RunningReplica) -> float:
        """Outstanding requests over the controller's routing weight (1, or less for a
        replica throttled by the cluster SLA rule, which so gets a smaller share)."""
        stats = replica.routing_stats or {}
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        outstanding = cached if cached is not None else int(stats.get("num_streams", 0))
        return weighted_load(outstanding, stats.get("routing_weight", 1.0))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return self.ranked(candidate_replicas, (), {})
        # Without it Serve retries a request whose replicas are all full (or slow to answer
        # its queue-length probe) at once and forever, flooding them with probes.
        pending_request.routing_context.should_backoff = True
        return self.ranked(candidate_replicas, pending_request.args, pending_request.kwargs)

    def pick(self, args: Sequence[Any], kwargs: dict[str, Any]) -> RunningReplica | None:
        """The replica for an `EngineServer.generate` call the ingress sends to the replica's
        actor itself (serve_app.transport.direct_calls): the first choice among the replicas
        with room by the queue-length cache, or None when none is known to have room (then
        the call goes through Serve's routing, which waits, probes and backs off)."""
        ranks = self.ranked(self.select_available_replicas(), args, kwargs)
        return ranks[0][0] if ranks else None

    def _held_blocks(self, replica: RunningReplica) -> Holding:
        stats = replica.routing_stats or {}
        return self.published.held(replica.replica_id.unique_id, stats.get("kv_blocks"))

    def ranked(
        self,
        candidates: list[RunningReplica],
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> list[list[RunningReplica]]:
        """Ranks of `candidates` for a call with these arguments, the preferred first."""
        if not candidates:
            return []
        target = kwargs.get("replica_id")
        if target is not None:
            pinned = [r for r in candidates if r.replica_id.unique_id == target]
            # Not (or no longer) one of ours: any replica answers that it is not the one
            # asked for, and the caller decides. (An empty answer would keep one of Serve's
            # routing tasks on this request for good; with a replica gone, those it has
            # left, two per replica, could all be stuck so, and nothing would be routed.)
            return [pinned or candidates]
        # Shuffle first so equally loaded replicas share the work.
        ranked = random.sample(candidates, len(candidates))
        ranked.sort(key=self.replica_load)
        resume = kwargs.get("resume")
        if resume is not None and resume.kv is not None and len(ranked) > 1:
            context = len(_prompt_of(args) or ()) + len(resume.output_token_ids)
            need = -(-context // self.block_size)
            return with_room_first(ranked, _free_blocks, need)
        lora = kwargs.get("lora")
        if lora is not None and len(ranked) > 1:
            ranks = adapter_first(
                ranked, _held_adapters, self.replica_load, lora[0], self.max_imbalance
            )
            if ranks is not None:
                return ranks
        prompt = _prompt_of(args)
        if self.kv_aware and prompt and len(ranked) > 1:
            if len(self.published) > len(self.curr_replicas):  # some were removed
                self.published.forget_others({r.unique_id for r in self.curr_replicas})
            keys = prompt_block_hashes(prompt, self.block_size)
            shared = self.shared.observe(
                prompt, keys, self.block_size, time.monotonic(), len(ranked)
            )
            load, held = self.replica_load, self._held_blocks
            ranks = kv_ranked(ranked, keys, load, held, self.kv_weight, _cache_fill, shared)
            if keys:  # the first choice: where the prompt goes unless that replica refuses it
                self.published.sent(ranks[0][0].replica_id.unique_id, keys)
            return ranks
        if self.prefix_affinity and prompt and len(ranked) > 1:
            key = prefix_key(prompt, self.prefix_tokens)
            return affinity_ranked(ranked, _unique_id, key, self.replica_load, self.max_imbalance)
        # One rank: Serve takes the lowest queue length among those that accept.
        return [ranked]


def adapter_first(
    ranked: list[R],
    held: Callable[[R], Iterable[str]],
    load: Callable[[R], float],
    adapter: str,
    max_imbalance: float,
) -> list[list[R]] | None:
    """The replicas holding `adapter` (least loaded first), then the rest; None where none
    holds it or the least loaded holder is busier than the least loaded replica by over
    `max_imbalance` (`ranked`: least loaded first)."""
    holders = [r for r in ranked if adapter in held(r)]
    if holders and load(holders[0]) - load(ranked[0]) <= max_imbalance:
        return [holders, [r for r in ranked if r not in holders]]
    return None


def with_room_first(ranked: list[R], free: Callable[[R], int | None], need: int) -> list[list[R]]:
    """The replicas with `need` free KV blocks or more (or not saying: older ones), in the
    order of `ranked` (least loaded first), then the rest."""
    roomy = [r for r in ranked if (n := free(r)) is None or n >= need]
    if not roomy or len(roomy) == len(ranked):
        return [ranked]
    return [roomy, [r for r in ranked if r not in roomy]]


def _unique_id(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


def _free_blocks(replica: RunningReplica) -> int | None:
    return (replica.routing_stats or {}).get("kv_free_blocks")


def _cache_fill(replica: RunningReplica) -> float:
    return (replica.routing_stats or {}).get("kv_cache_fill", 0.0)


def _held_adapters(replica: RunningReplica) -> list[str]:
    return (replica.routing_stats or {}).get("loras", [])


def _prompt_of(args: Sequence[Any]) -> list[int] | None:
    """EngineServer.generate(request_id, prompt_token_ids, params): the token ids, if any."""
    prompt = args[1] if len(args) >= 2 else None
    return prompt if isinstance(prompt, list) else None
