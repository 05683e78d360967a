"""KV-aware routing's view of the engine replicas: the keys of the prompt blocks each one's
prefix cache holds, published every second in its routing stats (engine/core/block_hashes.py);
the choice among them is cluster/prefix_routing.py's."""

from __future__ import annotations

from array import array


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
