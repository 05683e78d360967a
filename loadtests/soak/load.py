"""The soak's clients: each request of a kind (a stream, a whole completion, a streamed chat,
a stream the client aborts, a client that goes away before the answer, a bad body), sent
over HTTP and judged against what an undisturbed server answered for the same prompt.

Outcomes: `ok`; `wrong` (another text than the reference: greedy decoding must not change
with load, preemption or a replica's death); `lost` (a valid request that failed: a 5xx, a
dropped connection, a stream without its end); `hung` (not ended within the deadline);
`rejected` (429: the client is told to come back, nothing was accepted); `aborted` and
`disconnected` (the client left on purpose); for bad bodies `refused` (the 4xx expected,
naming the field) or `wrong`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

KINDS = {"stream": 35, "whole": 15, "chat": 20, "abort": 10, "disconnect": 10, "bad": 10}
# Bad bodies (a patch of a valid completion body), the status and the field the error names.
BAD_BODIES: list[tuple[dict, int, str]] = [
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"prompt": 123}, 400, "prompt"),
    ({"n": 0}, 400, "n"),
    ({"logprobs": 999}, 400, "logprobs"),
]
DISCONNECT_AFTER_S = 0.3
# A request is hung past its deadline; the client waits this much longer for the stacks.
HUNG_GRACE_S = 30.0
DISCONNECT_TOKENS = 512


@dataclass
class Outcome:
    kind: str
    status: str
    seconds: float
    detail: str = ""


def prompt_pool(size: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs of several lengths."""
    rng = random.Random(seed)
    words = ["the", "a", "river", "stone", "light", "winter", "market", "song", "garden", "road"]
    pool = []
    for i in range(size):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 60)))
        pool.append((f"Story {i}: {text}", rng.choice([16, 32, 64, 128])))
    return pool


class Clients:
    """Sends the soak's requests to one server (`base`: up to /v1) and judges them."""

    def __init__(
        self,
        base: str,
        model: str,
        pool: list[tuple[str, int]],
        deadline_s: float,
    ) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = deadline_s + HUNG_GRACE_S
        self.http = httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits)
        self.model = model
        self.pool = pool
        self.deadline_s = deadline_s
        self.completion_refs: list[str] = []
        self.chat_refs: list[str] = []
        self.in_flight: dict[int, float] = {}  # request key -> its start (monotonic)
        self._ids = 0

    async def references(self) -> None:
        """Every prompt's greedy answer from the undisturbed server, one at a time."""
        for i in range(len(self.pool)):
            resp = await self.http.post("/completions", json=self._completion_body(i))
            resp.raise_for_status()
            self.completion_refs.append(resp.json()["choices"][0]["text"])
            resp = await self.http.post("/chat/completions", json=self._chat_body(i))
            resp.raise_for_status()
            self.chat_refs.append(resp.json()["choices"][0]["message"]["content"])

    async def close(self) -> None:
        await self.http.aclose()

    def _completion_body(self, i: int, stream: bool = False) -> dict:
        prompt, max_tokens = self.pool[i]
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }

    def _chat_body(self, i: int, stream: bool = False) -> dict:
        prompt, max_tokens = self.pool[i]
        messages = [{"role": "user", "content": prompt}]
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens}
        return body | {"temperature": 0, "ignore_eos": True, "stream": stream}

    async def send(self, kind: str, rng: random.Random, label: str | None = None) -> Outcome:
        """One request of `kind` (reported as `label`, default the kind), judged. One not
        ended within the deadline is `hung`; the client waits HUNG_GRACE_S longer before it
        gives up, so that the watchdog can take the stacks while it hangs."""
        i = rng.randrange(len(self.pool))
        self._ids += 1
        key, start = self._ids, time.monotonic()
        self.in_flight[key] = start
        try:
            sender = getattr(self, f"_send_{kind}")
            status, detail = await asyncio.wait_for(sender(i, rng), self.deadline_s + HUNG_GRACE_S)
        except TimeoutError:
            status, detail = "hung", "never ended"
        except StatusError as exc:
            status, detail = _failed(exc.status, exc.body)
        except httpx.HTTPError as exc:
            status, detail = "lost", repr(exc)
        finally:
            self.in_flight.pop(key, None)
        seconds = time.monotonic() - start
        if seconds > self.deadline_s and status != "hung":
            status, detail = "hung", f"ended {status} after {seconds:.1f} s {detail}"
        return Outcome(label or kind, status, seconds, f"prompt {i}: {detail}" if detail else "")

    def oldest_age(self) -> float:
        """Seconds the oldest request in flight has run (0 with none)."""
        return time.monotonic() - min(self.in_flight.values(), default=time.monotonic())

    async def _send_stream(self, i: int, rng: random.Random) -> tuple[str, str]:
        text, done = await self._read_stream("/completions", self._completion_body(i, True))
        return _judge(text, done, self.completion_refs[i])

    async def _send_chat(self, i: int, rng: random.Random) -> tuple[str, str]:
        text, done = await self._read_stream("/chat/completions", self._chat_body(i, True))
        return _judge(text, done, self.chat_refs[i])

    async def _send_whole(self, i: int, rng: random.Random) -> tuple[str, str]:
        resp = await self.http.post("/completions", json=self._completion_body(i))
        if resp.status_code != 200:
            return _failed(resp.status_code, resp.text)
        choice = resp.json()["choices"][0]
        finished = choice["finish_reason"] is not None
        return _judge(choice["text"], finished, self.completion_refs[i])

    async def _send_abort(self, i: int, rng: random.Random) -> tuple[str, str]:
        chunks = rng.randint(1, 4)
        async with self.http.stream(
            "POST", "/completions", json=self._completion_body(i, True)
        ) as r:
            if r.status_code != 200:
                return _failed(r.status_code, (await r.aread()).decode())
            async for line in r.aiter_lines():
                chunks -= line.startswith("data: ")
                if chunks <= 0:
                    return "aborted", ""
        return "ok", "ended before the client aborted it"

    async def _send_disconnect(self, i: int, rng: random.Random) -> tuple[str, str]:
        body = self._completion_body(i) | {"max_tokens": DISCONNECT_TOKENS}
        try:
            resp = await self.http.post("/completions", json=body, timeout=DISCONNECT_AFTER_S)
        except httpx.TimeoutException:
            return "disconnected", ""
        return ("ok", "") if resp.status_code == 200 else _failed(resp.status_code, resp.text)

    async def _send_bad(self, i: int, rng: random.Random) -> tuple[str, str]:
        patch, status, param = rng.choice(BAD_BODIES)
        resp = await self.http.post("/completions", json=self._completion_body(i) | patch)
        try:
            error = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = {}
        if resp.status_code == status and error.get("param") == param:
            return "refused", ""
        return "wrong", f"{patch}: {resp.status_code} {resp.text[:200]}"

    async def _read_stream(self, route: str, body: dict) -> tuple[str, bool]:
        """The streamed text and whether the stream ended as it should (a finish_reason,
        then [DONE]); an error status raises a StatusError."""
        text, finished, done = [], False, False
        async with self.http.stream("POST", route, json=body) as r:
            if r.status_code != 200:
                raise StatusError(r.status_code, (await r.aread()).decode())
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise StatusError(500, data)
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                    text.append(delta)
                    finished |= choice.get("finish_reason") is not None
        return "".join(text), finished and done


class StatusError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:200]}")
        self.status, self.body = status, body


def _failed(status: int, body: str) -> tuple[str, str]:
    return ("rejected" if status == 429 else "lost"), f"{status}: {body[:200]}"


def _judge(text: str, finished: bool, reference: str) -> tuple[str, str]:
    if not finished:
        return "lost", "the answer ended without its finish"
    if text != reference:
        return "wrong", f"{text[:60]!r} != {reference[:60]!r}"
    return "ok", ""
