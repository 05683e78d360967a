"""The step scheduled while the step before it is in flight
(engine/core/sched/continuation.py): it is exactly the step the scheduler would schedule once
that step's tokens are in, or None."""

from __future__ import annotations

import copy
from dataclasses import fields

from engine.core.lora_slots import LoRARequest, LoRASlots
from engine.core.outputs import UNKNOWN_TOKEN, SchedulerOutput
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.core.sched.continuation import schedule_continuation
from engine.core.sched.scheduler import Scheduler
from tests.engine.helpers import fake_run, make_request, make_scheduler, step


def decoding(sched: Scheduler, *requests) -> Scheduler:
    for request in requests:
        sched.add_request(request)
    while sched.stats().num_decoding < len(sched.running) or sched.waiting:
        step(sched)
    return sched


def rows(out: SchedulerOutput, previous_token: int | None = None) -> list[dict]:
    """Every field of each row; `previous_token` stands for UNKNOWN_TOKEN (the token the step
    before samples, which the runner has) in its input and in the tokens penalties count."""

    def known(ids: list[int] | None) -> list[int] | None:
        if ids is None or previous_token is None:
            return ids
        return [previous_token if t == UNKNOWN_TOKEN else t for t in ids]

    return [
        {f.name: getattr(s, f.name) for f in fields(s)}
        | {"token_ids": known(s.token_ids), "seen_token_ids": known(s.seen_token_ids)}
        | {"block_ids": list(s.block_ids)}
        for s in out.scheduled
    ]


def test_the_continuation_is_the_step_scheduled_after_the_tokens_are_in():
    sched = make_scheduler(block_size=4, max_num_seqs=6)
    sched.loras = LoRASlots(1)
    sched = decoding(
        sched,
        *(make_request(f"r{i}", 5 + i, max_tokens=30) for i in range(2)),
        # A row with an adapter keeps its slot.
        Request("r5", [11] * 5, SamplingParams(max_tokens=30), lora=LoRARequest("a", 1, "/a")),
        # Stop tokens banned until min_tokens, in the continuation as in the step after.
        make_request("r2", 7, max_tokens=30, ignore_eos=False, min_tokens=8),
        # Penalties count the token in flight (UNKNOWN_TOKEN here); logprobs need nothing.
        make_request("r3", 6, max_tokens=30, frequency_penalty=0.5, logprobs=2),
        make_request("r4", 3, max_tokens=30, repetition_penalty=1.2),
    )
    for _ in range(12):  # across block boundaries: each crossing allocates a block
        previous = sched.schedule()
        twin, twin_previous = copy.deepcopy((sched, previous))
        continuation = schedule_continuation(sched, previous)
        assert continuation is not None
        assert all(s.token_ids == [UNKNOWN_TOKEN] and s.sample for s in continuation.scheduled)
        twin.update_from_output(twin_previous, fake_run(twin_previous))
        expected = twin.schedule()
        sched.update_from_output(previous, fake_run(previous))
        sched.check_integrity()
        assert rows(continuation, previous_token=7) == rows(expected)  # fake_run's token
        sched.update_from_output(continuation, fake_run(continuation))
        sched.check_integrity()


def test_a_request_the_step_in_flight_ends_by_length_is_left_out():
    sched = decoding(
        make_scheduler(), make_request("short", 4, max_tokens=3), make_request("long", 4)
    )
    previous = sched.schedule()  # samples short's third token: its last
    continuation = schedule_continuation(sched, previous)
    assert continuation is not None
    assert [s.request_id for s in continuation.scheduled] == ["long"]
    sched.update_from_output(previous, fake_run(previous))
    assert "short" not in sched.requests
    sched.update_from_output(continuation, fake_run(continuation))
    sched.check_integrity()


def test_none_while_a_waiting_request_could_be_admitted():
    sched = decoding(make_scheduler(max_num_seqs=2), make_request("a", 4, max_tokens=20))
    previous = sched.schedule()
    sched.add_request(make_request("b", 4))  # arrives while `previous` is in flight
    assert schedule_continuation(sched, previous) is None
    full = decoding(make_scheduler(max_num_seqs=1), make_request("a", 4, max_tokens=20))
    previous = full.schedule()
    full.add_request(make_request("b", 4))  # cannot be admitted: a continuation goes on
    assert schedule_continuation(full, previous) is not None


def test_none_for_grammar_rows_whose_matchers_need_the_step_before_on_the_host():
    spec = StructuredOutput("regex", "[a-z]+")
    sched = decoding(
        make_scheduler(),
        make_request("plain", 4, max_tokens=20),
        make_request("held", 4, structured=spec),
    )
    assert schedule_continuation(sched, sched.schedule()) is None


def test_none_when_the_next_slot_needs_a_block_the_pool_lacks():
    # Two requests of 4-token blocks, 8 blocks in all: both cross a boundary at once.
    sched = decoding(
        make_scheduler(num_blocks=8, block_size=4),
        make_request("a", 7, max_tokens=20),
        make_request("b", 7, max_tokens=20),
    )
    while sched.kv_cache.num_free_blocks:
        step(sched)
    previous = sched.schedule()
    free_before = sched.kv_cache.num_free_blocks
    continued = 0
    while (continuation := schedule_continuation(sched, previous)) is not None:
        sched.update_from_output(previous, fake_run(previous))
        previous, continued = continuation, continued + 1
    assert continued > 0 and sched.kv_cache.num_free_blocks == free_before == 0
    assert sched.requests["a"].num_computed_tokens % 4 == 3  # its next slot needs a block
    sched.update_from_output(previous, fake_run(previous))
    sched.check_integrity()
