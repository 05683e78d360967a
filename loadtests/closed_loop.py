"""A closed loop of streaming clients (each sends its next request when the previous one
ends), in process against AsyncLLMEngine or over HTTP (SSE) against the OpenAI API, with
per-request timings."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from cluster.metrics import percentile
from engine.core.sampling_params import SamplingParams
from loadtests import cpu_accounting
from loadtests.workload import WorkItem


@dataclass
class RequestTiming:
    start: float
    first_token: float | None = None
    end: float = 0.0
    tokens: int = 0
    request_id: str | None = None  # over HTTP: the response's id

    @property
    def ttft(self) -> float:
        return (self.first_token or self.end) - self.start

    @property
    def itl(self) -> float | None:
        if self.tokens < 2 or self.first_token is None:
            return None
        return (self.end - self.first_token) / (self.tokens - 1)


@dataclass
class RunResult:
    wall_s: float
    timings: list[RequestTiming] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per process name
    steal_frac: float = 0.0  # share of the machine's CPU time stolen by the hypervisor
    engine_step_s: float = float("nan")  # time inside engine.step() during the run

    def cpu_ms_per_token(self) -> dict[str, float]:
        tokens = max(1, sum(t.tokens for t in self.timings))
        return {name: round(1e3 * s / tokens, 3) for name, s in self.cpu_s.items()}

    def summary(self) -> dict[str, float]:
        tokens = sum(t.tokens for t in self.timings)
        ttft = sorted(t.ttft for t in self.timings)
        itl = sorted(x for t in self.timings if (x := t.itl) is not None)
        return {
            "tok_s": tokens / self.wall_s,
            "wall_s": self.wall_s,
            "output_tokens": tokens,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50),
            "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50),
            "itl_p99_ms": 1e3 * percentile(itl, 99),
            "engine_busy_frac": self.engine_step_s / self.wall_s,
            "steal_frac": self.steal_frac,
            # Throughput per CPU second the guest actually got: what comparisons across rounds
            # on a shared VM can lean on.
            "tok_s_steal_adjusted": cpu_accounting.steal_adjusted(
                tokens / self.wall_s, self.steal_frac
            ),
        }


async def closed_loop(items: list[WorkItem], concurrency: int, one) -> RunResult:
    """`concurrency` workers; each takes the next item when its last request ended."""
    queue: asyncio.Queue[WorkItem] = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    timings: list[RequestTiming] = []

    async def worker() -> None:
        while not queue.empty():
            timings.append(await one(queue.get_nowait()))

    cpu_before, machine_before = cpu_accounting.snapshot(), cpu_accounting.machine_times()
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    steal = cpu_accounting.steal_fraction(machine_before, cpu_accounting.machine_times())
    return RunResult(wall, timings, cpu_accounting.cpu_by_process(cpu_before), steal)


# --------------------------------------------------------------------------- in process
async def inprocess_request(engine, it: WorkItem) -> RequestTiming:
    """One request to `engine` (an AsyncLLMEngine on the running event loop), streamed."""
    params = SamplingParams(temperature=0.0, max_tokens=it.max_tokens, ignore_eos=True)
    t = RequestTiming(time.perf_counter())
    async for out in engine.generate(it.prompt_token_ids, params, it.request_id):
        if out.new_token_ids and t.first_token is None:
            t.first_token = time.perf_counter()
        t.tokens = out.num_output_tokens
    t.end = time.perf_counter()
    return t


async def run_inprocess(engine, items: list[WorkItem], concurrency: int) -> RunResult:
    """`engine` is an AsyncLLMEngine; its loop lives on the running event loop."""

    async def one(it: WorkItem) -> RequestTiming:
        return await inprocess_request(engine, it)

    await one(items[0])  # warm-up: first-use costs stay out of the figure
    busy = engine.step_seconds_total
    result = await closed_loop(items, concurrency, one)
    result.engine_step_s = engine.step_seconds_total - busy
    return result


# --------------------------------------------------------------------------------- HTTP
async def run_http(
    base_v1: str | list[str], model: str, items: list[WorkItem], concurrency: int
) -> RunResult:
    """`base_v1`: one server, or several (each ingress replica's own URL) taken in turns by
    the requests. Streams with usage at the end only (as `vllm bench serve` asks), through
    the lean client of loadtests/sse_client.py."""
    from loadtests.sse_client import SseClient

    clients = [SseClient(base) for base in ([base_v1] if isinstance(base_v1, str) else base_v1)]
    turns = itertools.cycle(clients)

    async def one(it: WorkItem) -> RequestTiming:
        return await http_request(next(turns), model, it)

    from ray import serve

    engine = serve.get_deployment_handle("EngineServer", app_name="bench")
    try:
        await one(items[0])
        busy = (await engine.stats.remote())["step_seconds_total"]
        result = await closed_loop(items, concurrency, one)
        result.engine_step_s = (await engine.stats.remote())["step_seconds_total"] - busy
        return result
    finally:
        for client in clients:
            await client.close()


async def http_request(client, model: str, it: WorkItem) -> RequestTiming:
    """One request through `client` (loadtests.sse_client.SseClient), streamed with usage at
    the end only (as `vllm bench serve` asks)."""
    body = {
        "model": model,
        "max_tokens": it.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if it.chat is None:
        route, body["prompt"] = "/completions", it.prompt_token_ids
    else:
        route, body["messages"] = "/chat/completions", [{"role": "user", "content": it.chat}]
    t = RequestTiming(time.perf_counter())
    streamed = await client.stream(route, body)
    t.first_token, t.end, t.tokens = streamed.first_event, streamed.end, streamed.tokens
    t.request_id = streamed.request_id
    return t
