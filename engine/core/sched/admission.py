"""The admission half of a scheduler step (pure Python)."""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field

from engine.core.outputs import ScheduledRequest
from engine.core.request import Request, RequestStatus
from engine.core.sched.request_order import aging_order
from engine.core.sched.state import SchedulerState
from engine.core.sequence_kv import SequenceKV


@dataclass
class Admitted:
    """What admission added to a step: the rows of the requests admitted, the swap-in copies
    to make, the carried KV to write (with the blocks it goes into), the budget left."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    kv_imports: list[tuple[SequenceKV, list[int]]] = field(default_factory=list)
    budget: int = 0


def admit_waiting(s: SchedulerState, budget: int, allowed: bool = True) -> Admitted:
    """After the running requests took their tokens: waiting requests in order while
    `budget`, `max_num_seqs` and free blocks allow (none unless `allowed`)."""
    out = Admitted()
    swap_in, scheduled = out.swap_in, out.scheduled
    kv = s.kv_cache
    if s.config.batching == "static" and not s.running:
        s.static_admitted = 0
    if s.config.scheduling_policy != "fcfs" and len(s.waiting) > 1 and budget > 0:
        oldest = s.clock.now() - s.config.aging_s
        s.waiting = aging_order(s.waiting, s.order_key, oldest)
    loras = s.loras
    no_slot: list[Request] = []  # their adapters wait for a slot; the rest go ahead
    while allowed and s.waiting and budget > 0 and s.may_admit():
        request = s.waiting[0]
        if loras is not None and not loras.can_acquire(request.lora):
            no_slot.append(s.waiting.popleft())
            continue
        admitted = kv.admit_waiting(request, budget, request.status == RequestStatus.SWAPPED)
        if admitted is None:
            break
        n, copies = admitted
        swap_in += copies
        carried = request.carried_kv
        if carried is not None:
            out.kv_imports.append((carried, kv.block_ids(request.request_id)[: carried.num_blocks]))
            request.carried_kv = None
        s.waiting.popleft()
        if loras is not None:
            request.lora_slot = loras.acquire(request.lora)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = s.clock.now()
        if request.num_preemptions:
            request.resumed_at_step = s.num_steps_total
        insort(s.running, request, key=s.order_key)
        s.static_admitted += 1
        scheduled.append(ScheduledRequest.of(request, n, kv.block_ids(request.request_id)))
        budget -= n
    s.waiting.extendleft(reversed(no_slot))
    out.budget = budget
    return out
