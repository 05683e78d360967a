"""Delta links (serve_app/transport/delta_link.py) over real loopback sockets: an outbox's
batches reach the ingress's end in order, and a link's end, from either side, ends the
channel's open requests at the engine replica and tells the ingress; engine calls sent on a
link (serve_app/transport/link_call.py) run at the replica and end with the link."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.core.outputs import RequestOutput
from serve_app.transport import delta_link
from serve_app.transport.delta_channel import Outboxes, unpacked
from serve_app.transport.link_call import LinkCallServer


def _delta(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, [token], str(token), finished, None, 3, 1)


class _Ingress:
    """What an ingress's end collects: the batches' deltas, and how the link ended."""

    def __init__(self) -> None:
        self.deltas: list[tuple[str, int]] = []
        self.ended: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    def batch(self, data: bytes) -> None:
        self.deltas += [(d.request_id, d.new_token_ids[0]) for d in unpacked(data)]

    def lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_result(exc)


async def _linked(channel: str):
    lost: list[str] = []
    outboxes = Outboxes()
    listener = delta_link.LinkListener("127.0.0.1", lambda c: (lost.append(c), outboxes.lost(c)))
    await listener.start()
    assert listener.address is not None
    ingress = _Ingress()
    reader = await delta_link.connect(listener.address, channel, ingress.batch, ingress.lost)
    assert reader is not None and channel in listener.sinks
    return outboxes, listener, ingress, reader, lost


def test_batches_reach_the_ingress_in_order_and_the_subscription_yields_none():
    async def run() -> None:
        outboxes, listener, ingress, reader, _ = await _linked("ingress-1/abc")
        outbox = outboxes.open("ingress-1/abc")
        yielded = []

        async def subscription() -> None:
            sink = listener.sinks["ingress-1/abc"]
            async for data in outboxes.subscribe("ingress-1/abc", sink):
                yielded.append(data)

        task = asyncio.create_task(subscription())
        for step in range(50):
            outbox.put(_delta("a", step))
            outbox.put(_delta("b", step, finished=step == 49))
            await asyncio.sleep(0.001)
        outboxes.close("ingress-1/abc", outbox)
        deadline = asyncio.get_running_loop().time() + 5
        while len(ingress.deltas) < 100 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert [t for r, t in ingress.deltas if r == "a"] == list(range(50))
        assert [t for r, t in ingress.deltas if r == "b"] == list(range(50))
        assert reader.num_frames == outbox.num_batches >= 1 and not yielded
        task.cancel()
        reader.close()
        listener.close()

    asyncio.run(run())


def test_the_ingress_leaving_ends_the_channels_open_requests():
    async def run() -> None:
        outboxes, listener, ingress, reader, lost = await _linked("ingress-1/abc")
        outbox = outboxes.open("ingress-1/abc")
        reader.close()  # as when the ingress replica dies
        deadline = asyncio.get_running_loop().time() + 5
        while not lost and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert lost == ["ingress-1/abc"] and outbox.owner_gone
        assert "ingress-1/abc" not in listener.sinks
        # Requests that come later get an outbox of their own, not the ended one.
        assert outboxes.open("ingress-1/abc") is not outbox
        listener.close()

    asyncio.run(run())


def test_a_second_link_for_a_channel_ends_the_requests_of_the_first():
    """The ingress connects again only after it lost its link: what ran on the old one ends
    (the old connection may look alive here still, as a half-open one does)."""

    async def run() -> None:
        outboxes, listener, ingress, first, lost = await _linked("ingress-1/abc")
        outbox = outboxes.open("ingress-1/abc")
        again = await delta_link.connect(
            listener.address, "ingress-1/abc", ingress.batch, lambda _: None
        )
        assert again is not None and lost == ["ingress-1/abc"] and outbox.owner_gone
        assert outboxes.open("ingress-1/abc") is not outbox
        # The old connection closed from the replica's end: the ingress's old reader ends.
        assert await asyncio.wait_for(ingress.ended, 5) is None
        again.close()
        listener.close()

    asyncio.run(run())


def test_the_engine_replica_closing_its_end_is_the_ingresss_link_lost():
    async def run() -> None:
        outboxes, listener, ingress, reader, _ = await _linked("ingress-1/abc")
        listener.close()  # as when the engine replica stops
        # A clean close: no exception, still the end of every delta it would have brought.
        assert await asyncio.wait_for(ingress.ended, 5) is None

    asyncio.run(run())


def test_no_listener_means_no_link():
    async def run() -> None:
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        ingress = _Ingress()
        link = await delta_link.connect(("127.0.0.1", port), "c", ingress.batch, ingress.lost)
        assert link is None and not ingress.ended.done()

    asyncio.run(run())


class _Replica:
    """An engine replica's method behind the links' engine calls: yields `count` items, or
    waits after the first until cancelled (`aborted` then says so), or fails."""

    def __init__(self) -> None:
        self.aborted = asyncio.Event()
        self.counted = 0

    async def generate(self, count: int, hold: bool = False, fail: bool = False):
        try:
            for i in range(count):
                yield i
            if fail:
                raise ValueError("bad step")
            if hold:
                await asyncio.sleep(3600)
        finally:
            if hold:
                self.aborted.set()

    @contextlib.contextmanager
    def count(self):
        self.counted += 1
        try:
            yield
        finally:
            self.counted -= 1


async def _with_calls(channel: str):
    replica = _Replica()
    server = LinkCallServer(replica.generate, replica.count)
    outboxes = Outboxes()
    listener = delta_link.LinkListener("127.0.0.1", outboxes.lost, server.on_message)
    await listener.start()
    assert listener.address is not None
    ingress = _Ingress()
    reader = await delta_link.connect(listener.address, channel, ingress.batch, ingress.lost)
    assert reader is not None and reader.takes_calls
    return replica, server, outboxes, listener, ingress, reader


def test_a_call_on_the_link_runs_at_the_replica_and_its_items_come_back_in_order():
    """Items, the end and an error come back on the call; the channel's batches still reach
    the ingress on the same link; Serve's count holds the call while it runs."""

    async def run() -> None:
        replica, server, outboxes, listener, ingress, reader = await _with_calls("i/a")
        ended = []
        call = reader.call("r1", (5,), {}, on_end=lambda: ended.append("r1"))
        assert [item async for item in call] == [0, 1, 2, 3, 4]
        assert ended == ["r1"] and not reader.calls and server.num_calls == 1
        failing = reader.call("r2", (1,), {"fail": True})
        assert await anext(failing) == 0
        with pytest.raises(ValueError, match="bad step"):
            await anext(failing)
        outbox = outboxes.open("i/a")
        task = asyncio.create_task(anext(outboxes.subscribe("i/a", listener.sinks["i/a"])))
        outbox.put(_delta("x", 7, finished=True))
        for _ in range(200):
            if ingress.deltas:
                break
            await asyncio.sleep(0.005)
        assert ingress.deltas == [("x", 7)]
        assert replica.counted == 0
        task.cancel()
        listener.close()

    asyncio.run(run())


def test_a_cancelled_call_and_a_broken_link_end_the_call_at_the_replica():
    async def run() -> None:
        replica, _, _, listener, _, reader = await _with_calls("i/a")
        call = reader.call("r1", (1,), {"hold": True})
        assert await anext(call) == 0
        assert replica.counted == 1
        call.cancel()
        await asyncio.wait_for(replica.aborted.wait(), 5)
        with pytest.raises(StopAsyncIteration):
            await anext(call)
        replica.aborted.clear()
        held = reader.call("r2", (1,), {"hold": True})
        assert await anext(held) == 0
        listener.close()  # the replica's end goes: the call fails at the ingress, ends there
        with pytest.raises(delta_link.DeltaLinkLost):
            await asyncio.wait_for(anext(held), 5)
        await asyncio.wait_for(replica.aborted.wait(), 5)
        assert replica.counted == 0

    asyncio.run(run())
