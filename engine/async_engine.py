"""asyncio front of the engine: a step loop in one worker thread steps the engine.

One thread runs every torch op of the engine: on the CPU, libgomp gives each thread that
enters a parallel region a team of its own, and once the teams' threads outnumber the cores it
stops spinning between regions, so each of a step's many regions waits for its workers to
wake (docs/cpu-kernels.md). So the engine is built in the thread that steps it
(`AsyncLLMEngine.built`), and the work prepared off the loop (a grammar, an adapter read) runs
in a thread that ends with it, its team with it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from engine.core.errors import InvalidParam
from engine.core.outputs import RequestOutput
from engine.core.request import Request, Resume
from engine.core.sampling_params import SamplingParams
from engine.core.sequence_kv import SequenceKV, SequenceMoved
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncLLMEngine:
    """`async for out in engine.generate(...)` yields per-step deltas of one request.

    One worker thread steps the engine (the step loop) and is the only thread that changes
    it: requests to add and abort reach it through a locked inbox, read before each step, and
    each step's outputs go to the event loop in one callback. On a GPU (or emulated one) the
    step loop never waits for the event loop: the streams' consumers (SSE, delta channels,
    metrics) run while the next step does, instead of between steps, where they would leave
    the device idle once they and the step's own host work outlast a step. On the CPU the
    step's threads use every core and consumers beside them slow it by more than they take,
    so there the next step waits for the event loop to have run the last one's consumers
    (`lockstep`). Leaving the `async for` early (break, cancellation, client disconnect) aborts
    the request and frees its blocks within two steps.
    """

    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor | None = None) -> None:
        """`executor`: the one worker thread that steps `engine` (`built` passes the one that
        built it)."""
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # The inbox: written on the event loop, taken by the step loop before each step.
        self._inbox = threading.Lock()
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        # Work to do between steps (between_steps), each with the future of its result.
        self._pending_calls: list[tuple[Callable[[LLMEngine], object], asyncio.Future]] = []
        self._work = threading.Event()  # set when the inbox has something
        self._closing = False
        self._parked = False  # the step loop returned idle; the next request starts it again
        self._stepping: Future[None] | None = None  # the step loop, running in the executor
        self._event_loop: asyncio.AbstractEventLoop | None = None  # where outputs go
        self.lockstep = engine.config.device == "cpu"
        self._consumed = threading.Event()  # lockstep: the last step's consumers have run
        self._executor = executor or _step_executor()
        # Wall time inside engine.step(): against elapsed time it says how busy the engine is.
        self.step_seconds_total = 0.0
        self._step_started: float | None = None

    @classmethod
    def built(cls, make: Callable[[], LLMEngine]) -> AsyncLLMEngine:
        """The engine `make` builds, built in the thread that will step it (module doc)."""
        executor = _step_executor()
        try:
            return cls(executor.submit(make).result(), executor)
        except BaseException:
            executor.shutdown(wait=False)
            raise

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        resume: Resume | None = None,
        lora: tuple[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`lora`: the LoRA adapter to run with, (name, directory)."""
        if request_id in self._streams:
            raise InvalidParam("request_id", f"request_id {request_id!r} is already in use")
        # ValueError: bad input. A grammar compiles off the event loop (a big schema takes time).
        make = partial(self.engine.make_request, request_id, prompt, params, priority, resume, lora)
        # A grammar, or an adapter read for the first time, takes a while: off the loop.
        slow = (params and params.structured) or (lora and not self.engine.loras.holds(*lora))
        request = await in_passing_thread(make) if slow else make()
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        with self._inbox:
            self._pending_adds.append(request)
        self._kick()
        finished = False
        ending: BaseException | None = None  # read after deltas, raised once they are out
        try:
            while True:
                item, ending = (ending, None) if ending else _merged(await stream.get(), stream)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort_soon(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_soon(request_id)

    async def move_out(self, request_ids: list[str] | None = None) -> int:
        """End these requests here (every one held: None) between two steps, so that they go
        on at another replica: each one's stream raises SequenceMoved with its KV after its
        last delta. Returns how many moved."""
        return await self.between_steps(partial(self._move, request_ids))

    async def between_steps(self, work: Callable[[LLMEngine], T]) -> T:
        """`work(engine)` in the step loop, before its next step (the only thread that may
        read or change the engine's state); its result."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._inbox:
            self._pending_calls.append((work, done))
        self._kick()
        return await done

    def _abort_soon(self, request_id: str) -> None:
        with self._inbox:
            self._pending_aborts.append(request_id)
        self._kick()

    @property
    def num_streams(self) -> int:
        """Requests accepted and not yet ended (queued, running, or waiting to be added)."""
        return len(self._streams)

    @property
    def loop_error(self) -> BaseException | None:
        """The exception that ended the step loop, if it died (health checks)."""
        stepping = self._stepping
        if stepping is None or not stepping.done() or stepping.cancelled():
            return None
        return stepping.exception()

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until nothing is queued or running (for tests and graceful shutdown)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._has_pending() or self.engine.has_unfinished_requests():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("engine did not become idle")
            await asyncio.sleep(0.01)

    async def shutdown(self) -> None:
        self._closing = True
        self._work.set()
        self._consumed.set()
        self._executor.shutdown(wait=True)  # the step loop ends after the step it is in
        self.engine.close()

    # ------------------------------------------------------------------------ the loop
    def _timed_step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self._step_started = time.monotonic()
        try:
            return self.engine.step()
        finally:
            self._step_started = None
            self.step_seconds_total += time.perf_counter() - start

    @property
    def step_running_s(self) -> float:
        """How long the step running now has run (0 between steps): a stuck device shows."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def _kick(self) -> None:
        """Wake the step loop, or start it (the first time, after it parked, or if it died)."""
        self._event_loop = asyncio.get_running_loop()
        with self._inbox:
            if self._stepping is None or self._stepping.done() or self._parked:
                self._parked = False
                self._stepping = self._executor.submit(self._step_loop)
        self._work.set()

    def _step_loop(self) -> None:
        """The engine's thread: the inbox, then a step, for as long as there is work. Idle a
        while, it parks (returns): the executor's thread is then free to end with the process."""
        while not self._closing:
            self._work.clear()  # before the inbox is read: an add after this sets it again
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                if not self._work.wait(_PARK_AFTER_IDLE_S):
                    with self._inbox:
                        if not self._has_pending():
                            self._parked = True
                            return
                continue
            try:
                outputs = self._timed_step()
            except Exception as exc:  # the engine itself broke: fail every request it holds
                logger.exception("engine step raised")
                self.engine.num_failed_steps_in_a_row += 1
                self._post(self._fail, self.engine.abort_all(), exc)
                continue
            if not outputs:
                continue
            if self.lockstep:
                self._consumed.clear()
            if self._post(self._deliver, outputs) and self.lockstep:
                self._wait_for_consumers()

    def _wait_for_consumers(self) -> None:
        loop = self._event_loop
        while not self._consumed.wait(0.05):
            if self._closing or loop is None or loop.is_closed():
                return  # a closed loop drops the callback that would have said so

    def _has_pending(self) -> bool:
        return bool(self._pending_adds or self._pending_aborts or self._pending_calls)

    def _apply_pending(self) -> None:
        with self._inbox:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
            calls, self._pending_calls = self._pending_calls, []
        for request in adds:
            if request.request_id in aborts:
                continue  # cancelled before it was ever queued
            try:
                self.engine.add_prepared(request)
            except ValueError as exc:
                self._post(self._fail, [request.request_id], exc)
        if aborts:
            self.engine.abort(aborts)
        for work, done in calls:
            try:
                result = work(self.engine)
            except Exception as exc:
                self._post(_settle, done, None, exc)
            else:
                self._post(_settle, done, result, None)

    def _move(self, request_ids: list[str] | None, engine: LLMEngine) -> int:
        """Move requests out: the steps in flight are collected first, and their deltas
        delivered before the streams end."""
        settled = engine.settle()
        if settled:
            self._post(self._deliver, settled)
        ids = list(engine.scheduler.requests) if request_ids is None else request_ids
        moved = engine.move_out(ids)
        self._post(self._moved, moved)
        return len(moved)

    def _post(self, callback: Callable[..., None], *args: object) -> bool:
        """`callback(*args)` on the event loop (from the step loop); False if it has closed."""
        loop = self._event_loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(callback, *args)
                return True
        except RuntimeError:  # that loop has closed: nobody listens to these requests
            self.engine.abort_all()
        return False

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
        if self.lockstep:  # said after the consumers these outputs woke (queued before it)
            asyncio.get_running_loop().call_soon(self._consumed.set)

    def _moved(self, moved: dict[str, SequenceKV | None]) -> None:
        for request_id, kv in moved.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(SequenceMoved(request_id, kv))

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(exc)


_PARK_AFTER_IDLE_S = 1.0


def _settle(done: asyncio.Future, result: object, error: Exception | None) -> None:
    if done.done():  # its caller was cancelled meanwhile
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


def _merged(
    item: RequestOutput | BaseException, stream: asyncio.Queue[RequestOutput | BaseException]
) -> tuple[RequestOutput | BaseException, BaseException | None]:
    """`item` merged with the deltas queued behind it (a slow consumer gets them as one),
    and the exception that ends the stream where one is queued after them: the deltas go
    out first (a request moved out has its last tokens there)."""
    while isinstance(item, RequestOutput) and not item.finished and not stream.empty():
        later = stream.get_nowait()
        if isinstance(later, BaseException):
            return item, later
        item = item.merge(later)
    return item, None


def _step_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")


async def in_passing_thread(work: Callable[[], T]) -> T:
    """`work` in a thread of its own that ends with it (an OpenMP team it starts goes too)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # the caller was cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = work()
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="engine-prepare", daemon=True).start()
    return await done
