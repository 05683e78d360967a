"""Taking running requests off the device to free their blocks (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request, RequestStatus
from engine.core.sched.state import SchedulerState


@dataclass
class MadeRoom:
    """What making room for one request did: whether its slots were allocated (False: it
    went itself), the requests preempted, worst first, and the swap-out copies to make."""

    allocated: bool = True
    request_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)


def preempt(s: SchedulerState, request: Request) -> list[tuple[int, int]]:
    """Send a running request back to the head of `s`'s waiting queue: its KV copied to the
    host pool under swap preemption (progress kept; the copies to make are returned), else
    dropped to be recomputed. The caller takes it out of `running`."""
    s.release_lora(request)
    request.num_preemptions += 1
    s.num_preemptions_total += 1
    s.waiting.appendleft(request)
    if s.config.preemption_mode == "swap":
        copies = s.kv_cache.swap_out(request)
        if copies is not None:  # KV kept on the host; progress kept
            request.status = RequestStatus.SWAPPED
            s.num_swap_outs_total += 1
            return copies
    # Recompute (or swap with a full host pool): drop the KV and start over.
    s.kv_cache.free(request.request_id)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    return []


def allocate_or_preempt(s: SchedulerState, request: Request, n: int, position: int) -> MadeRoom:
    """Allocate `n` slots for `request` (at `position` in `s.running`), preempting requests
    ranked after it, worst first, as needed."""
    made = MadeRoom()
    while s.kv_cache.allocate_slots(request, n) is None:
        victim = s.pick_victim(position)
        made.swap_out += preempt(s, victim)
        made.request_ids.append(victim.request_id)
        if victim is request:
            made.allocated = False
            break
    return made
