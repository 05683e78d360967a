"""The step after a step still in flight, scheduled before that step's tokens are known, so a
GPU can start it as soon as the one before ends (pure Python).

It exists only where the scheduler can tell it already: every running request was in the
step in flight, samples there and decodes on; no waiting request could be admitted; each
request's next slot can be allocated without preempting. Its rows' input token is the one
the step in flight samples (UNKNOWN_TOKEN: the runner takes it from that step's sampled
tokens on the device). A request the step in flight ends by length is left out; one it ends
otherwise (a stop token, a stop string found later) computes a row whose token is dropped.
"""

from __future__ import annotations

from engine.core.outputs import UNKNOWN_TOKEN, ScheduledRequest, SchedulerOutput
from engine.core.request import RequestStatus
from engine.core.sched.scheduler import Scheduler


def schedule_continuation(
    scheduler: Scheduler, previous: SchedulerOutput
) -> SchedulerOutput | None:
    """The step after `previous` (launched, not yet collected), or None where it cannot be
    told yet. Grammar rows make it None: their matchers need the step before's tokens on
    the host."""
    if scheduler.waiting and scheduler.may_admit():
        return None
    # After drafts, how far each request got is not known yet; and a speculator that would
    # draft must see the step's requests first.
    spec = scheduler.speculator
    if spec is not None and (previous.num_draft_tokens or not spec.continues()):
        return None
    requests = scheduler.requests
    running = RequestStatus.RUNNING
    live = [
        s for s in previous.scheduled if (r := requests.get(s.request_id)) and r.status is running
    ]
    if len(live) != len(scheduler.running) or len(live) > scheduler.limits.max_num_batched_tokens:
        return None
    kv = scheduler.kv_cache
    max_model_len = scheduler.config.max_model_len
    rows: list[ScheduledRequest] = []
    for s in live:
        params = s.sampling_params
        if not s.sample or params.structured is not None:
            return None
        request = requests[s.request_id]
        num_output = request.num_output_tokens + 1  # with the token `previous` samples
        if num_output >= params.max_tokens or request.num_tokens + 1 >= max_model_len:
            continue  # `previous` ends it
        position = request.num_computed_tokens + s.num_tokens
        if kv.allocate_slots(request, s.num_tokens + 1) is None:
            return None
        banned = tuple(sorted(request.stop_token_ids)) if num_output < params.min_tokens else ()
        # Penalties count the token `previous` samples: the runner has it on the device.
        seen = request.all_token_ids + [UNKNOWN_TOKEN] if params.penalized else None
        block_ids = kv.block_ids(s.request_id)
        rows.append(
            ScheduledRequest(
                s.request_id,
                [UNKNOWN_TOKEN],
                position,
                block_ids,
                True,
                params,
                num_output,
                banned,
                seen,
                lora_slot=request.lora_slot,
            )
        )
    if not rows:
        return None
    ended, scheduler.ended_since_last_step = scheduler.ended_since_last_step, []
    scheduler.num_steps_total += 1
    scheduler.steps.scheduled(len(rows), len(rows))
    return SchedulerOutput(scheduled=rows, num_batched_tokens=len(rows), finished_request_ids=ended)
