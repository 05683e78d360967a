"""AsyncLLMEngine: streams deltas, aborts on cancel and frees blocks, steps off the loop and
without waiting for it."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from engine.async_engine import AsyncLLMEngine
from engine.core.sampling_params import SamplingParams
from tests.conftest import build_engine


def make_engine(tiny_model) -> AsyncLLMEngine:
    return AsyncLLMEngine(
        build_engine(tiny_model, num_blocks=300, max_num_seqs=8, max_num_batched_tokens=32)
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def assert_all_blocks_free(engine: AsyncLLMEngine) -> None:
    kv = engine.engine.scheduler.kv_cache
    engine.engine.scheduler.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


async def stream_all(
    engine: AsyncLLMEngine, prompts: list[str], params: SamplingParams
) -> list[list[int]]:
    """Every prompt streamed at once (request ids r0, r1, ...): each one's tokens, once the
    engine is idle again."""

    async def collect(i: int) -> list[int]:
        tokens = []
        async for out in engine.generate(prompts[i], params, request_id=f"r{i}"):
            tokens.extend(out.new_token_ids)
        return tokens

    got = await asyncio.gather(*(collect(i) for i in range(len(prompts))))
    await engine.wait_idle()
    return got


def test_concurrent_streams_match_offline_generate(tiny_model):
    prompts = ["one", "two two", "three three three", "four"]

    async def main():
        engine = make_engine(tiny_model)
        got = await stream_all(engine, prompts, greedy(12))
        assert_all_blocks_free(engine)
        await engine.shutdown()
        return got

    got = asyncio.run(main())
    offline = make_engine(tiny_model).engine.generate(prompts, greedy(12))
    assert got == [r.token_ids for r in offline]


def test_leaving_the_stream_early_aborts_and_frees_blocks(tiny_model):
    async def main():
        engine = make_engine(tiny_model)
        seen = 0
        async for out in engine.generate("a long story", greedy(200), request_id="quit"):
            seen += len(out.new_token_ids)
            if seen >= 3:
                break

        # A cancelled consumer task does the same.
        async def consume():
            async for _ in engine.generate("another", greedy(200), request_id="cancel"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.wait_idle()
        assert engine.num_streams == 0
        assert_all_blocks_free(engine)
        await engine.shutdown()
        return seen

    assert asyncio.run(main()) == 3


def test_bad_input_raises_at_once_and_others_keep_streaming(tiny_model):
    async def main():
        engine = make_engine(tiny_model)
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=2.0)
        with pytest.raises(ValueError, match="prompt"):
            async for _ in engine.generate("", greedy(4), request_id="bad"):
                pass
        n = 0
        async for out in engine.generate("fine", greedy(5), request_id="ok"):
            n += len(out.new_token_ids)
        await engine.wait_idle()
        assert_all_blocks_free(engine)
        await engine.shutdown()
        return n

    assert asyncio.run(main()) == 5


def test_forward_runs_off_the_event_loop_thread(tiny_model):
    async def main():
        engine = make_engine(tiny_model)
        step_threads = set()
        runner = engine.engine.runner
        original = runner.launch

        def recording_launch(out):
            step_threads.add(threading.get_ident())
            return original(out)

        runner.launch = recording_launch
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick_task = asyncio.create_task(ticker())
        async for _ in engine.generate("hello", greedy(30), request_id="t"):
            pass
        tick_task.cancel()
        await engine.shutdown()
        return step_threads, ticks

    threads, ticks = asyncio.run(main())
    assert threads and threading.get_ident() not in threads
    assert ticks > 30  # the loop kept running between and during steps


@pytest.mark.parametrize("lockstep", [False, True])
def test_a_busy_event_loop_holds_the_engine_only_in_lockstep(tiny_model, lockstep):
    """Off lockstep (a GPU's way) the step loop does not wait for the streams' consumers:
    while the event loop is held (a slow consumer, SSE writes), steps go on, and the next delta
    carries every token they made. In lockstep (the CPU's) the next step waits for the last
    one's consumers. Tokens are those of generate alone either way."""

    async def main():
        engine = make_engine(tiny_model)
        assert engine.lockstep  # the tiny engine runs on the CPU
        engine.lockstep = lockstep
        stream = engine.generate("a long story", greedy(60), request_id="busy")
        tokens = list((await anext(stream)).new_token_ids)
        time.sleep(0.5)  # holds the event loop: none of its callbacks run meanwhile
        after_busy = await anext(stream)
        tokens += after_busy.new_token_ids
        async for out in stream:
            tokens += out.new_token_ids
        await engine.wait_idle()
        assert_all_blocks_free(engine)
        await engine.shutdown()
        return tokens, len(after_busy.new_token_ids)

    tokens, made_while_busy = asyncio.run(main())
    if lockstep:
        assert made_while_busy <= 2  # the step in flight, and one launched ahead with it
    else:
        assert made_while_busy >= 10
    offline = make_engine(tiny_model).engine.generate(["a long story"], greedy(60))
    assert tokens == offline[0].token_ids


def test_a_built_engine_steps_in_the_thread_that_built_it_with_its_thread_count(tiny_model):
    """AsyncLLMEngine.built: every torch op of the engine in one thread (OpenMP gives each
    thread its own team: engine/async_engine.py), at engine.num_threads."""
    from engine.core.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine

    wanted = len(os.sched_getaffinity(0)) + 1  # not OpenMP's default
    config = EngineConfig(
        model=tiny_model, num_threads=wanted, cache=CacheConfig(block_size=4, num_blocks=64)
    )
    built_in = []

    def make() -> LLMEngine:
        built_in.append(threading.get_ident())
        return LLMEngine(config)

    async def main():
        engine = AsyncLLMEngine.built(make)
        runner = engine.engine.runner
        original, seen = runner.launch, set()

        def recording_launch(out):
            seen.add((threading.get_ident(), torch.get_num_threads()))
            return original(out)

        runner.launch = recording_launch
        async for _ in engine.generate("hello", greedy(5), request_id="t"):
            pass
        await engine.shutdown()
        return seen

    assert asyncio.run(main()) == {(built_in[0], wanted)}
