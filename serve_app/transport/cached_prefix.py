"""KV-aware routing's view of the engine replicas: the keys of the prompt blocks each one's
prefix cache holds (published every second in its routing stats, engine/core/block_hashes.py),
and the replica a prompt should go to: the lowest outstanding load, less `weight` times the
share of the prompt's full blocks it holds as a prefix."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")


class PublishedBlocks:
    """Each replica's published keys, decoded once per publication."""

    def __init__(self) -> None:
        self._by_replica: dict[str, tuple[bytes, frozenset[int]]] = {}

    def held(self, replica_id: str, published: bytes | None) -> frozenset[int]:
        known = self._by_replica.get(replica_id)
        if known is not None and known[0] is published:
            return known[1]
        keys = array("q")
        keys.frombytes(published or b"")
        held = frozenset(keys)
        self._by_replica[replica_id] = (published or b"", held)
        return held

    def __len__(self) -> int:
        return len(self._by_replica)

    def forget_others(self, replica_ids: set[str]) -> None:
        """Drop replicas no longer among `replica_ids` (removed ones)."""
        for gone in set(self._by_replica) - replica_ids:
            del self._by_replica[gone]


def cached_prefix(keys: list[int], held: frozenset[int]) -> int:
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
    held: Callable[[R], frozenset[int]],
    weight: float,
) -> list[list[R]]:
    """Ranks of `ranked` (least loaded first) for a prompt whose full blocks have `keys`: the
    replica with the best score, then the rest."""
    if not keys:
        return [ranked]

    def score(replica: R) -> float:
        return load(replica) - weight * cached_prefix(keys, held(replica)) / len(keys)

    best = min(ranked, key=score)  # the first of equals: the least loaded
    return [[best], [r for r in ranked if r is not best]]
