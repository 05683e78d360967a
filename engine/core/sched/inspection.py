"""Reading a scheduler from outside: its stats snapshot and its integrity check (pure
Python)."""

from __future__ import annotations

from dataclasses import replace

from engine.core.errors import InvalidParam
from engine.core.outputs import SchedulerStats
from engine.core.request import Request, RequestStatus
from engine.core.sched.state import SchedulerState


def scheduler_stats(s: SchedulerState) -> SchedulerStats:
    """A plain snapshot of the scheduler and its KV cache (stats, reports, /metrics)."""
    steps = s.steps
    return SchedulerStats(
        num_running=len(s.running),
        num_waiting=len(s.waiting),
        num_free_blocks=s.kv_cache.num_free_blocks,
        num_used_blocks=s.kv_cache.num_used_blocks,
        num_total_blocks=s.kv_cache.num_blocks,
        kv_usage=s.kv_cache.usage(),
        max_num_seqs=s.limits.max_num_seqs,
        max_num_batched_tokens=s.limits.max_num_batched_tokens,
        num_preemptions_total=s.num_preemptions_total,
        num_steps_total=s.num_steps_total,
        num_finished_total=dict(s.num_finished_total),
        num_decoding=steps.last_num_decodes,
        last_step_num_seqs=steps.last_num_seqs,
        last_step_decode_only=steps.last_decode_only,
        last_step_duration_s=steps.last_duration_s,
        decode_steps_total=steps.decode_steps_total,
        decode_step_seconds_total=steps.decode_step_seconds_total,
        decode_step_seqs_total=steps.decode_step_seqs_total,
        prefix_cache_queries=s.kv_cache.prefix_queries,
        prefix_cache_hits=s.kv_cache.prefix_hits,
        num_swapped=len(s.kv_cache.swapped_ids()),
        num_swap_outs_total=s.num_swap_outs_total,
        num_free_host_blocks=s.kv_cache.num_free_host_blocks,
        spec=_spec_snapshot(s),
        max_loras=s.loras.num_slots if s.loras is not None else 0,
        running_loras=_adapter_names(s.running),
        waiting_loras=_adapter_names(s.waiting),
    )


def _adapter_names(requests) -> tuple[str, ...]:
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))


def _spec_snapshot(s: SchedulerState):
    if s.speculator is None:
        return None
    stats = s.speculator.stats
    return replace(stats, accepted_per_position=list(stats.accepted_per_position))


def check_request(s: SchedulerState, request: Request) -> None:
    """Raise InvalidParam if the request could never run on `s`. Reads only the config."""
    if request.num_prompt_tokens < 1:
        raise InvalidParam("prompt", "prompt must contain at least one token")
    params = request.sampling_params
    generated = 0 if params.pooling is not None else params.max_tokens  # embeddings: none
    total = request.num_prompt_tokens + generated
    if total > s.config.max_model_len:
        raise InvalidParam(
            "prompt",
            f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({generated}) = {total} "
            f"exceeds max_model_len ({s.config.max_model_len})",
        )
    if s.kv_cache.blocks_needed(total) > s.kv_cache.num_blocks:
        raise InvalidParam(
            "prompt",
            f"prompt + max_tokens ({total} tokens) needs more KV blocks than the cache "
            f"holds ({s.kv_cache.num_blocks} of {s.kv_cache.block_size} tokens)",
        )


def check_integrity(s: SchedulerState) -> None:
    """Raise AssertionError if the queues, the request index and the KV tables disagree
    (run when the engine is idle and after every test)."""
    s.kv_cache.check_integrity()
    live = {r.request_id for r in s.running} | {r.request_id for r in s.waiting}
    assert live == set(s.requests), "request index out of step with the queues"
    assert len(live) == len(s.running) + len(s.waiting), "a request is queued twice"
    for r in s.running:
        assert r.status == RequestStatus.RUNNING, r
    for r in s.waiting:
        assert r.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
            RequestStatus.SWAPPED,
        ), r
        if r.status == RequestStatus.PREEMPTED:
            assert r.num_computed_tokens == 0, r
    swapped = {r.request_id for r in s.waiting if r.status == RequestStatus.SWAPPED}
    assert s.kv_cache.swapped_ids() == swapped, "host tables out of step with requests"
    # NOTE: only running requests hold blocks; waiting and preempted ones hold none.
    assert s.kv_cache.request_ids() == {r.request_id for r in s.running}, "orphan table"
    # Between steps no request holds a block its tokens do not need, but for drafts of a step
    # still in flight (rejected drafts' slots go back when they are verified).
    for r in s.running:
        held = len(s.kv_cache.block_ids(r.request_id))
        needed = s.kv_cache.blocks_needed(r.num_tokens + r.num_drafts_in_flight)
        assert held <= needed, f"{r}: {held} blocks held"
    if s.loras is not None:  # a running request with an adapter holds its slot; none else
        s.loras.check()
        for r in s.running:
            assert (r.lora is None) == (r.lora_slot < 0), f"{r}: slot {r.lora_slot}"
        for r in s.waiting:
            assert r.lora_slot < 0, f"{r} waits holding slot {r.lora_slot}"
