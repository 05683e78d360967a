"""Outbox, the engine replica's end of a delta channel: batching and when a subscription ends."""

from __future__ import annotations

import asyncio
import dataclasses

from engine.core.outputs import RequestOutput, TokenLogprob
from serve_app.transport.delta_channel import Outbox, packed, unpacked


def _delta(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[token],
        new_text=str(token),
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=3,
        num_output_tokens=1,
    )


def test_one_take_carries_every_delta_queued_since_the_last():
    async def run() -> list[list[str]]:
        outbox = Outbox()
        outbox.num_open = 3
        taken = asyncio.create_task(outbox.take(idle_s=5))
        await asyncio.sleep(0)  # the subscriber waits
        for rid in ("a", "b", "c"):  # one engine step's deltas, put back to back
            outbox.put(_delta(rid, 1))
        first = await taken
        outbox.put(_delta("a", 2, finished=True))
        second = await outbox.take(idle_s=5)
        assert (outbox.num_batches, outbox.num_deltas) == (2, 4)
        return [[d.request_id for d in first], [d.request_id for d in second]]

    assert asyncio.run(run()) == [["a", "b", "c"], ["a"]]


def test_a_packed_batch_unpacks_to_equal_deltas_with_every_field():
    full = RequestOutput(
        request_id="a",
        new_token_ids=[5, 6],
        new_text="five six",
        finished=True,
        finish_reason="stop",
        num_prompt_tokens=3,
        num_output_tokens=2,
        error="late",
        queue_time_s=0.25,
        num_preemptions=1,
        logprobs=[TokenLogprob(-0.5, [(5, -0.5)]), TokenLogprob(-1.0, [(6, -1.0)])],
        prompt_logprobs=[None, TokenLogprob(-2.0, [])],
        embedding=[0.5, -0.5],
        num_cached_tokens=2,
    )
    # Every field differs from its default: one the rows left out would show.
    defaults = RequestOutput("b", [], "", False, None, 0, 0)
    for f in dataclasses.fields(RequestOutput):
        assert getattr(full, f.name) != getattr(defaults, f.name), f.name
    batch = [full, _delta("b", 7)]
    assert unpacked(packed(batch)) == batch
    assert unpacked(batch) == batch  # as an engine replica of the version before sends it


def test_take_ends_only_when_idle_and_nothing_is_open():
    async def run() -> tuple[object, object]:
        outbox = Outbox()
        outbox.num_open = 1
        waiting = asyncio.create_task(outbox.take(idle_s=0.05))
        await asyncio.sleep(0.2)  # several idle periods pass: a request is still open
        still_waiting = not waiting.done()
        outbox.put(_delta("a", 7, finished=True))
        batch = await waiting
        outbox.num_open = 0
        ended = await outbox.take(idle_s=0.05)
        return still_waiting and [d.new_token_ids for d in batch], ended

    got, ended = asyncio.run(run())
    assert got == [[7]]
    assert ended is None


def test_unread_deltas_with_nobody_left_are_abandoned():
    outbox = Outbox()
    outbox.put(_delta("a", 1, finished=True))
    assert not outbox.abandoned  # just written: its subscriber may be on the way
    outbox._last_read -= 1e6
    assert outbox.abandoned and not outbox.unused
    outbox.num_subscribers = 1
    assert not outbox.abandoned
