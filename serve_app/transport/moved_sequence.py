"""A sequence that leaves a stopping engine replica with its KV, as the ingress sees it.

The replica ends the request's deltas with one whose finish_reason is "moved" (through its
delta channel when it has one, so it comes after every token), and its engine call then
yields `MovedOut`: the KV's ObjectRef in Ray's object store. That call stays open, holding
the KV, until the ingress has resumed the sequence elsewhere and cancels it; so the KV is
freed at the source once the target took it, and a target that dies first leaves it for the
next one. A source that dies first leaves nothing to fetch: the target computes the context
again, as after any lost replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.request import RequestStatus

MOVED = RequestStatus.FINISHED_MOVED.finish_reason


@dataclass(frozen=True)
class MovedOut:
    """The last item of a moved request's engine call."""

    kv: Any  # ray.ObjectRef of the engine.core.sequence_kv.SequenceKV, or None: none exported


class SequenceLeft(Exception):
    """The sequence's engine replica moved it out; `kv` gives its KV's ObjectRef (or None)."""

    def __init__(self, request_id: str, kv: Any) -> None:
        super().__init__(f"request {request_id} left its engine replica")
        self.kv = kv
