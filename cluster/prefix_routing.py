"""Where a prompt should go by its prefix, the rules the ingress's router applies
(serve_app/transport/router.py) and the cluster simulator applies the same way:

- prefix affinity: rendezvous hashing of the first `prefix_tokens` prompt tokens over replica
  ids, so every router sends the same prefix to the same replica without sharing state, and a
  replica joining or leaving moves only its own share of prefixes; it yields to load when the
  preferred replica is `max_imbalance` requests busier than the least loaded;
- KV-aware: the replica whose load less `weight` times the share of the prompt's full blocks
  it holds as a prefix (engine/core/block_hashes.py's keys), plus `weight` times the share
  of its cache that cached blocks fill, is lowest; a prefix shared by enough prompts
  (cluster/shared_prefixes.py) counts as held by every replica.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class PrefixRouting:
    """The simulator's `routing:` (serve_app.config.RoutingArgs, the same defaults): by the
    blocks each replica holds (`kv_aware`), else by the hash of the first `prefix_tokens`."""

    kv_aware: bool = False
    prefix_tokens: int = 64
    max_imbalance: int = 8
    kv_weight: float = 8.0


def prefix_key(token_ids: list[int], prefix_tokens: int) -> bytes:
    return hashlib.blake2b(array("q", token_ids[:prefix_tokens]).tobytes(), digest_size=8).digest()


def rendezvous_choice(key: bytes, replica_ids: list[str]) -> str:
    """The replica id with the highest hash(key, id): stable, and uniform over prefixes."""
    return max(
        replica_ids, key=lambda rid: hashlib.blake2b(key + rid.encode(), digest_size=8).digest()
    )


def affinity_ranked(
    ranked: list[R],
    replica_id: Callable[[R], str],
    key: bytes,
    load: Callable[[R], float],
    max_imbalance: float,
) -> list[list[R]]:
    """Ranks of `ranked` (least loaded first) for a prompt of prefix `key`: its rendezvous
    replica first unless that one is busier than the least loaded by over `max_imbalance`."""
    by_id = {replica_id(r): r for r in ranked}
    preferred = by_id[rendezvous_choice(key, list(by_id))]
    if load(preferred) - load(ranked[0]) <= max_imbalance:
        return [[preferred], [r for r in ranked if r is not preferred]]
    return [ranked]


def cached_prefix(keys: list[int], held: Container[int]) -> int:
    """How many of a prompt's leading blocks (`keys`, in order) a replica holds."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


def kv_ranked(
    ranked: list[R],
    keys: list[int],
    load: Callable[[R], float],
    held: Callable[[R], Container[int]],
    weight: float,
    fill: Callable[[R], float] | None = None,
    shared: int = 0,
) -> list[list[R]]:
    """Ranks of `ranked` (least loaded first) for a prompt whose full blocks have `keys`: the
    replica with the best score, then the rest. A replica's score is its load less `weight`
    times the share of the prompt it holds as a prefix, plus `weight` times the share of its
    cache that cached blocks fill (`fill`): what the prompt would write evicts others' there,
    and not on a replica with room. Without the second term, the first replica to cache a
    prefix every conversation shares (a system prompt) would take every new conversation
    while its load stayed under `weight`, more than its cache holds; where every cache is
    full (a long-running app's), it is the same for all and the first decides. The first
    `shared` blocks count as held by every replica: a prefix worth a copy on each
    (cluster/shared_prefixes.py), which no replica should win prompts by holding first."""
    if not keys:
        return [ranked]

    def score(replica: R) -> float:
        share = max(cached_prefix(keys, held(replica)), shared) / len(keys)
        return load(replica) - weight * (share - (fill(replica) if fill is not None else 0.0))

    best = min(ranked, key=score)  # the first of equals: the least loaded
    return [[best], [r for r in ranked if r is not best]]
