"""One level of a sweep: a closed loop (concurrency) or an open loop (Poisson rate) of
streamed requests through the `openai` client, each request timed."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from loadtests.sweep.prompt_source import PromptSource


@dataclass
class RequestResult:
    start_s: float  # since the level began
    status: str = "ok"  # ok | 429 | http_<code> | error:<Type>
    ttft_s: float | None = None
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0  # the server's usage count
    tokens_received: int = 0  # summed from per-chunk usage deltas

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else None


async def one_request(
    client, model: str, prompt: list[int], max_tokens: int, t0: float
) -> RequestResult:
    import openai

    started = time.perf_counter()
    res = RequestResult(start_s=started - t0)
    last = started
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for chunk in stream:
            now = time.perf_counter()
            usage = chunk.usage
            if usage is None:
                continue
            new = usage.completion_tokens - seen
            if new > 0:
                if res.ttft_s is None:
                    res.ttft_s = now - started
                    new_gaps = new - 1  # tokens after the first in the first chunk
                else:
                    new_gaps = new
                if new_gaps > 0:
                    res.gaps_s.extend([(now - last) / new] * new_gaps)
                seen = usage.completion_tokens
                last = now
            res.prompt_tokens = usage.prompt_tokens
            res.output_tokens = usage.completion_tokens
        res.tokens_received = seen
    except openai.RateLimitError:
        res.status = "429"
    except openai.APIStatusError as exc:
        res.status = f"http_{exc.status_code}"
    except Exception as exc:  # timeouts, connection resets: counted, never raised
        res.status = f"error:{type(exc).__name__}"
    res.e2e_s = time.perf_counter() - started
    return res


# ----------------------------------------------------------------------------- levels
@dataclass
class LevelResult:
    mode: str  # concurrency | rate
    value: float
    wall_s: float
    requests: list[RequestResult]


class Progress:
    """One line on stderr per level, redrawn as requests complete (no dependency)."""

    def __init__(self, label: str, total_s: float, enabled: bool) -> None:
        self.label, self.total_s, self.enabled = label, total_s, enabled
        self.t0 = time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        frac = min((time.perf_counter() - self.t0) / max(self.total_s, 1e-9), 1.0)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label:>18} [{bar:<30}] {done} done")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def run_level(
    client,
    model: str,
    source: PromptSource,
    mode: str,
    value: float,
    duration_s: float,
    max_requests: int,
    seed: int,
    progress: bool,
) -> LevelResult:
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    results: list[RequestResult] = []
    bar = Progress(f"{mode} {value:g}", duration_s, progress)
    issued = 0

    def take() -> tuple[list[int], int] | None:
        nonlocal issued
        if issued >= max_requests or time.perf_counter() >= deadline:
            return None
        issued += 1
        return source.next()

    async def send(item: tuple[list[int], int]) -> None:
        results.append(await one_request(client, model, item[0], item[1], t0))
        bar.update(len(results))

    if mode == "concurrency":

        async def worker() -> None:
            while (item := take()) is not None:
                await send(item)

        await asyncio.gather(*(worker() for _ in range(int(value))))
    else:
        rng = random.Random(seed)
        tasks = []
        next_at = t0
        while (item := take()) is not None:
            next_at += rng.expovariate(value)
            delay = next_at - time.perf_counter()
            if next_at >= deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(item)))
        await asyncio.gather(*tasks)
    bar.close()
    return LevelResult(mode, value, time.perf_counter() - t0, results)
