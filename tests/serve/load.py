"""Load for the serving tests: HTTP requests from a background thread, and polling."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx


def wait_for(predicate, timeout: float, what: str, period: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def _complete(client: httpx.AsyncClient, base: str, i: int, max_tokens: int) -> int:
    r = await client.post(
        f"{base}/v1/completions",
        json={
            "model": "tiny",
            "prompt": f"request {i} says",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=300,
    )
    return r.status_code


class Load:
    """Requests from a background thread: `burst` at once (again and again until stopped with
    `waves`), or a steady trickle until stopped."""

    def __init__(
        self,
        base: str,
        burst: int = 0,
        trickle: bool = False,
        max_tokens: int = 64,
        waves: bool = False,
    ):
        self.base, self.burst, self.trickle, self.max_tokens = base, burst, trickle, max_tokens
        self.waves = waves
        self.codes: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=300)

    async def _run(self) -> None:
        async with httpx.AsyncClient() as client:
            tasks = [
                asyncio.create_task(_complete(client, self.base, i, self.max_tokens))
                for i in range(self.burst)
            ]
            i = self.burst
            while self.trickle and not self.stop.is_set():
                self.codes.append(await _complete(client, self.base, i, 8))
                i += 1
                await asyncio.sleep(0.1)
            self.codes.extend(await asyncio.gather(*tasks))
            while self.waves and not self.stop.is_set():
                wave = [_complete(client, self.base, i, self.max_tokens) for i in range(self.burst)]
                self.codes.extend(await asyncio.gather(*wave))

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()
