"""Taking a running request off the device to free its blocks (pure Python)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler


def preempt(s: Scheduler, request: Request) -> None:
    """Send a running request back to the head of `s`'s waiting queue: its KV copied to the
    host pool under swap preemption (progress kept), else dropped to be recomputed. The
    caller takes it out of `running`."""
    s.release_lora(request)
    request.num_preemptions += 1
    s.num_preemptions_total += 1
    s.waiting.appendleft(request)
    if s.config.preemption_mode == "swap":
        copies = s.kv_cache.swap_out(request)
        if copies is not None:  # KV kept on the host; progress kept
            s._swap_out += copies
            request.status = RequestStatus.SWAPPED
            s.num_swap_outs_total += 1
            return
    # Recompute (or swap with a full host pool): drop the KV and start over.
    s.kv_cache.free(request.request_id)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0


def allocate_or_preempt(
    s: Scheduler, request: Request, n: int, preempted: list[str], position: int
) -> bool:
    """Allocate `n` slots for `request` (at `position` in `s.running`), preempting requests
    ranked after it, worst first, as needed. Returns False if `request` itself had to go."""
    while s.kv_cache.allocate_slots(request, n) is None:
        victim = s._pick_victim(position)
        preempt(s, victim)
        preempted.append(victim.request_id)
        if victim is request:
            return False
    return True
