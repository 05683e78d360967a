"""asyncio front of the engine: one background loop steps the engine in a worker thread.

One thread runs every torch op of the engine: on the CPU, libgomp gives each thread that
enters a parallel region a team of its own, and once the teams' threads outnumber the cores it
stops spinning between regions, so each of a step's many regions waits for its workers to
wake (docs/cpu-kernels.md). So the engine is built in the thread that steps it
(`AsyncLLMEngine.built`), and the work prepared off the loop (a grammar, an adapter read) runs
in a thread that ends with it, its team with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from engine.core.errors import InvalidParam
from engine.core.outputs import RequestOutput, merge_queued
from engine.core.request import Request, Resume
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncLLMEngine:
    """`async for out in engine.generate(...)` yields per-step deltas of one request.

    The engine is touched only between steps, from the event loop thread, and each step runs
    in a single worker thread, so the event loop is never blocked by a forward pass.
    Leaving the `async for` early (break, cancellation, client disconnect) aborts the request
    and frees its blocks before the next step.
    """

    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor | None = None) -> None:
        """`executor`: the one worker thread that steps `engine` (`built` passes the one that
        built it)."""
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
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
        self._pending_adds.append(request)
        self._kick()
        finished = False
        try:
            while True:
                item = merge_queued(await stream.get(), stream)
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
                self._pending_aborts.append(request_id)
                self._kick()

    async def abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        self._kick()

    @property
    def num_streams(self) -> int:
        """Requests accepted and not yet ended (queued, running, or waiting to be added)."""
        return len(self._streams)

    @property
    def loop_error(self) -> BaseException | None:
        """The exception that ended the background loop, if it died (health checks)."""
        task = self._loop_task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until nothing is queued or running (for tests and graceful shutdown)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._pending_adds or self._pending_aborts or self.engine.has_unfinished_requests():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("engine did not become idle")
            await asyncio.sleep(0.01)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self._executor.shutdown(wait=True)
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
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wakeup.set()

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for request in adds:
            if request.request_id in self._pending_aborts:
                continue  # cancelled before it was ever queued
            try:
                self.engine.add_prepared(request)
            except ValueError as exc:
                stream = self._streams.get(request.request_id)
                if stream is not None:
                    stream.put_nowait(exc)
        aborts, self._pending_aborts = self._pending_aborts, []
        if aborts:
            self.engine.abort(aborts)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                if not (self._pending_adds or self._pending_aborts):
                    await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self._timed_step)
            except Exception as exc:  # the engine itself broke: fail every open stream
                logger.exception("engine step raised")
                self.engine.num_failed_steps_in_a_row += 1
                for stream in self._streams.values():
                    stream.put_nowait(exc)
                self.engine.abort(list(self._streams))
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
            await asyncio.sleep(0)  # let consumers run before the next step


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
