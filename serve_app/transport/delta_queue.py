"""DeltaQueue: one request's deltas at the ingress, waiting for its response to send them.

They are counted in tokens: a client that stops reading makes them pile up here (when the
ingress's connection carries the client's backpressure), and past a bound, with nothing
taken for a while, its request ends. Tokens alone would also count a burst: a subscription
that was slow to run (a busy host) brings many engine steps at once, before the response
had a chance to take any.

It is a queue for one reader (the response) with its own waiter: asyncio.Queue's
bookkeeping for many getters and putters, and its loop lookup on every get, cost the ingress
a share of its CPU per streamed token.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from engine.core.outputs import RequestOutput

# A response that has more than its bound of tokens waiting is looked at this often; one
# that took none of them between two looks in a row has a client that stopped reading. (One
# look would also count an event loop that was held up: the response then had no chance.)
STALL_CHECK_S = 1.0


class DeltaQueue:
    def __init__(self, max_unsent_tokens: int | None = None) -> None:
        self._items: deque[RequestOutput | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None  # its reader's, while it waits
        self._loop: asyncio.AbstractEventLoop | None = None
        self.max_unsent_tokens = max_unsent_tokens  # None: no bound
        self.num_tokens = 0
        self.num_taken = 0  # items its response took so far (a reading client moves it)
        self.ended = False  # its last delta (or an error) has come
        # Called once its client counts as not reading (set by the request's stream).
        self.on_overflow: Callable[[int], None] | None = None
        self._stall_check: asyncio.TimerHandle | None = None

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        if isinstance(item, RequestOutput):
            self.ended |= item.finished
            self.num_tokens += len(item.new_token_ids)
            self._watch_bound()
        else:
            self.ended = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> RequestOutput | BaseException:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        self.num_taken += 1
        if isinstance(item, RequestOutput):
            self.num_tokens -= len(item.new_token_ids)
        return item

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._waiter = self._loop.create_future()
            await self._waiter
        return self.get_nowait()

    def close(self) -> None:
        """Its request ended here: no more checks."""
        if self._stall_check is not None:
            self._stall_check.cancel()
            self._stall_check = None

    def _past_bound(self) -> bool:
        limit = self.max_unsent_tokens
        return limit is not None and self.num_tokens > limit and self.on_overflow is not None

    def _watch_bound(self, looks: int = 0) -> None:
        """Past the bound: look again in STALL_CHECK_S whether the response took any."""
        if self._past_bound() and self._stall_check is None:
            self._stall_check = asyncio.get_running_loop().call_later(
                STALL_CHECK_S, self._check_stalled, self.num_taken, looks + 1
            )

    def _check_stalled(self, num_taken: int, looks: int) -> None:
        self._stall_check = None
        if not self._past_bound():
            return
        if self.num_taken != num_taken:  # it reads, slowly: start over
            self._watch_bound()
        elif looks < 2:
            self._watch_bound(looks)
        else:
            overflow, self.on_overflow = self.on_overflow, None
            assert overflow is not None
            overflow(self.num_tokens)
