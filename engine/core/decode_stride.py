"""Multi-step decode: a run of steps in which the batch only decodes, applied at once.

Between two events (an arrival, a finish, a change of limits) most steps of a busy engine
are the same batch decoding one more token each. `decode_horizon` reads from the
scheduler's state how many of the next steps are provably such steps, whatever the clock:
every running request decodes one token (no prefill chunk, no drafts), none ends, no
waiting request could be admitted, and the free blocks cover every block the run needs,
so nothing is preempted. `advance_decode` then applies k of them: the same blocks taken,
the same counters and step statistics as k calls of `schedule` and `update_from_output`.

The simulator prices such a run in one go (CostModelRunner.decode_run) instead of building
k SchedulerOutputs; what the caller must bound is time (the next arrival, tick or limits
change), which the scheduler cannot see. Pure Python.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from engine.core.kv_cache_manager import cdiv
from engine.core.request import RequestStatus

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler


def decode_horizon(s: Scheduler, token_id: int) -> int:
    """How many of the next steps only decode the running batch (0: the next one may not),
    when every sampled token is `token_id`."""
    running = s.running
    kv = s.kv_cache
    if not running or s.speculator is not None or kv.enable_prefix_caching:
        return 0
    if len(running) > s.limits.max_num_batched_tokens:
        return 0
    if s.waiting and not _admission_closed(s):
        return 0
    max_len = s.config.max_model_len
    k = sys.maxsize
    for r in running:
        if (
            r.num_tokens - r.num_computed_tokens != 1
            or not r.num_output_tokens
            or r.num_drafts_in_flight
            or token_id in r.stop_token_ids
        ):
            return 0
        # The step that ends a request (max_tokens or max_model_len) is not in the run.
        k = min(
            k, r.sampling_params.max_tokens - r.num_output_tokens - 1, max_len - r.num_tokens - 1
        )
    if k <= 0:
        return 0
    free = kv.num_free_blocks
    if blocks_for_run(s, k) <= free:
        return k
    lo, hi = 0, k  # the longest run whose blocks fit: need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if blocks_for_run(s, mid) <= free else (lo, mid)
    return lo


def blocks_for_run(s: Scheduler, k: int) -> int:
    """The blocks the running requests take over `k` decode steps."""
    kv = s.kv_cache
    bs = kv.block_size
    held = kv.block_tables
    need = 0
    for r in s.running:
        more = cdiv(r.num_computed_tokens + k, bs) - len(held.get(r.request_id, ()))
        if more > 0:
            need += more
    return need


def advance_decode(s: Scheduler, token_id: int, step_seconds: list[float]) -> None:
    """Apply len(step_seconds) decode steps of the running batch (within decode_horizon),
    each having taken that long."""
    k = len(step_seconds)
    kv = s.kv_cache
    for r in s.running:
        if kv.allocate_slots(r, k) is None:
            raise AssertionError(f"{r.request_id}: a decode run past its horizon")
        r.num_computed_tokens += k
        r.num_tokens += k
        r.num_output_tokens += k
        r.all_token_ids.extend([token_id] * k)
    # What the run's first step would have handed the runner, and its adapter loads.
    s._ended_since_last_step = []
    if s.loras is not None:
        s.loras.take_loads()
    s.num_steps_total += k
    s.steps.decode_run(len(s.running), step_seconds)


def _admission_closed(s: Scheduler) -> bool:
    """No waiting request can be admitted on any step of a decode run: admission is shut by
    the limits, or the head of an arrival-ordered queue needs more blocks than are free now
    (runs only take blocks)."""
    if not s._may_admit():
        return True
    budget = s.limits.max_num_batched_tokens - len(s.running)
    if budget <= 0:
        return True
    if s.config.scheduling_policy != "fcfs" or s.loras is not None:
        return False
    head = s.waiting[0]
    if head.status == RequestStatus.SWAPPED:
        return False
    need = cdiv(min(head.num_tokens, budget), s.kv_cache.block_size)
    return need > s.kv_cache.num_free_blocks
