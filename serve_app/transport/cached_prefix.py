"""KV-aware routing's view of the engine replicas: the keys of the prompt blocks each one's
prefix cache holds, published every second in its routing stats (engine/core/block_hashes.py),
and the keys of the prompts this router has sent it since; the choice among them is
cluster/prefix_routing.py's."""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable

# How long a prompt's keys count as held by the replica they were sent to without its
# publication saying so: a few of its publication periods (a second each), and the
# controller's broadcast of them.
SENT_HORIZON_S = 3.0


class Holding:
    """What a replica is taken to hold: its last publication's keys and those sent it since."""

    __slots__ = ("published", "sent")

    def __init__(self, published: frozenset[int], sent: OrderedDict[int, float]) -> None:
        self.published = published
        self.sent = sent

    def __contains__(self, key: object) -> bool:
        return key in self.published or key in self.sent


class PublishedBlocks:
    """Each replica's published keys, decoded once per publication, and the keys of the
    prompts sent to it in the last `horizon_s`. Until a replica publishes what it was sent, a
    router reading publications alone would see only the replica that published a shared
    prefix (a system prompt) first, and send it every new conversation after that prefix,
    however many the others had been sent too."""

    def __init__(
        self, horizon_s: float = SENT_HORIZON_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.horizon_s = horizon_s
        self.clock = clock
        self._by_replica: dict[str, tuple[bytes, frozenset[int]]] = {}
        self._sent: dict[str, OrderedDict[int, float]] = {}

    def held(self, replica_id: str, published: bytes | None) -> Holding:
        known = self._by_replica.get(replica_id)
        if known is None or known[0] is not published:
            keys = array("q")
            keys.frombytes(published or b"")
            known = (published or b"", frozenset(keys))
            self._by_replica[replica_id] = known
        return Holding(known[1], self._fresh_sent(replica_id))

    def sent(self, replica_id: str, keys: list[int]) -> None:
        """`keys` (a prompt's full blocks) were sent to `replica_id`: held there from now."""
        sent = self._fresh_sent(replica_id)
        now = self.clock()
        for key in keys:
            sent[key] = now
            sent.move_to_end(key)

    def _fresh_sent(self, replica_id: str) -> OrderedDict[int, float]:
        sent = self._sent.setdefault(replica_id, OrderedDict())
        oldest = self.clock() - self.horizon_s
        while sent and next(iter(sent.values())) < oldest:
            sent.popitem(last=False)
        return sent

    def __len__(self) -> int:
        return len(self._by_replica.keys() | self._sent.keys())

    def forget_others(self, replica_ids: set[str]) -> None:
        """Drop replicas no longer among `replica_ids` (removed ones)."""
        for gone in set(self._by_replica) - replica_ids:
            del self._by_replica[gone]
        for gone in set(self._sent) - replica_ids:
            del self._sent[gone]
