"""Which request goes first and which goes out first: the admission policies' orders, aging,
and the choice of a preemption victim (pure Python)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from engine.core.request import Request

# A request that came back from preemption is spared as a victim for this many steps
# (otherwise, being the most recently admitted, it is the next one out: thrash).
RESUME_GRACE_STEPS = 4


def fcfs_key(r: Request) -> tuple:
    return (r.arrival_time, r.seq)


def priority_key(r: Request) -> tuple:
    return (r.priority, r.arrival_time, r.seq)


def sjf_key(r: Request) -> tuple:
    return (r.num_prompt_tokens + r.sampling_params.max_tokens, r.arrival_time, r.seq)


POLICY_KEYS: dict[str, Callable[[Request], tuple]] = {
    "fcfs": fcfs_key,
    "priority": priority_key,
    "sjf": sjf_key,
}


def aging_order(
    waiting: Iterable[Request], key: Callable[[Request], tuple], oldest: float
) -> deque[Request]:
    """Policy order with aging: whoever arrived at `oldest` or before goes first (oldest
    first), then the rest by the policy's key."""
    return deque(
        sorted(
            waiting,
            key=lambda r: (0, r.arrival_time, r.seq) if r.arrival_time <= oldest else (1, *key(r)),
        )
    )


def pick_victim(running: list[Request], position: int, recent_step: int) -> Request:
    """Take out of `running` (kept in policy order) the worst-ranked request after
    `position`, sparing those that resumed after `recent_step` while another will do; the
    request at `position` itself when none is left."""
    for j in range(len(running) - 1, position, -1):
        if running[j].resumed_at_step < recent_step:
            return running.pop(j)
    return running.pop() if len(running) - 1 > position else running.pop(position)
