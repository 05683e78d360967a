"""DeltaQueue's bound: a response that takes nothing for two looks in a row while more than
max_unsent_tokens wait ends its request; a burst that it then takes, or a slow reader, does
not."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.transport import delta_queue
from serve_app.transport.delta_queue import DeltaQueue
from tests.serve.test_delta_channel import _delta

LOOK_S = 0.1


@pytest.fixture(autouse=True)
def short_looks(monkeypatch):
    monkeypatch.setattr(delta_queue, "STALL_CHECK_S", LOOK_S)


def _watched(limit: int) -> tuple[DeltaQueue, list[int]]:
    queue, cut = DeltaQueue(limit), []
    queue.on_overflow = cut.append
    return queue, cut


def test_a_response_that_takes_nothing_past_the_bound_is_cut_once():
    async def run() -> tuple[list[int], list[int]]:
        queue, cut = _watched(4)
        for token in range(6):
            queue.put_nowait(_delta("a", token))
        await asyncio.sleep(LOOK_S * 1.5)  # one look saw nothing taken: not yet
        early = list(cut)
        await asyncio.sleep(LOOK_S * 2)  # the second look, with no delta coming
        queue.put_nowait(_delta("a", 9))
        await asyncio.sleep(LOOK_S * 3)
        return early, cut

    early, cut = asyncio.run(run())
    assert early == [] and cut == [6]


def test_a_burst_taken_within_the_grace_is_not_cut():
    async def run() -> list[int]:
        queue, cut = _watched(4)
        for token in range(40):  # many engine steps in one subscription batch
            queue.put_nowait(_delta("a", token))
        await asyncio.sleep(LOOK_S * 1.5)  # a held-up response: the first look sees no take
        while not queue.empty():
            queue.get_nowait()
        await asyncio.sleep(LOOK_S * 3)
        return cut

    assert asyncio.run(run()) == []


def test_a_client_that_reads_slowly_is_not_cut_one_that_stops_is():
    async def run() -> tuple[list[int], list[int]]:
        queue, cut = _watched(4)
        for token in range(20):
            queue.put_nowait(_delta("a", token))
        for _ in range(6):  # one delta taken per look: behind, but reading
            await asyncio.sleep(LOOK_S)
            queue.get_nowait()
        reading = list(cut)
        await asyncio.sleep(LOOK_S * 4)  # then nothing taken
        return reading, cut

    reading, cut = asyncio.run(run())
    assert reading == [] and cut == [14]


def test_a_closed_queue_is_not_checked_and_no_bound_means_none():
    async def run() -> tuple[list[int], list[int]]:
        closed, closed_cut = _watched(2)
        unbounded = DeltaQueue(None)
        unbounded_cut: list[int] = []
        unbounded.on_overflow = unbounded_cut.append
        for token in range(10):
            closed.put_nowait(_delta("a", token))
            unbounded.put_nowait(_delta("b", token))
        closed.close()
        await asyncio.sleep(LOOK_S * 4)
        return closed_cut, unbounded_cut

    assert asyncio.run(run()) == ([], [])


def test_its_reader_waits_for_a_put_and_a_cancelled_wait_loses_nothing():
    async def run() -> list[object]:
        queue = DeltaQueue(None)
        waiting = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        waiting.cancel()  # a reader that left while it waited
        await asyncio.sleep(0)
        queue.put_nowait(_delta("a", 1))
        reader = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        assert not queue.ended
        queue.put_nowait(_delta("a", 2, finished=True))
        got = [(await reader).new_token_ids, (await queue.get()).new_token_ids]
        queue.put_nowait(ValueError("after the end"))
        return [waiting.cancelled(), *got, queue.ended, queue.num_taken]

    assert asyncio.run(run()) == [True, [1], [2], True, 2]
