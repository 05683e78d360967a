"""An engine replica's health (serve_app.replica.health) on a real AsyncLLMEngine: healthy while
it serves; unhealthy after max_failed_steps failed steps in a row (a sticky device error,
made here by taking the runner's KV cache away) and while one step runs past
step_timeout_s; healthy again once steps run."""

from __future__ import annotations

import asyncio

from engine.async_engine import AsyncLLMEngine
from engine.core.sampling_params import SamplingParams
from serve_app.replica.health import HealthArgs, health_problem
from tests.engine.test_async_engine import assert_all_blocks_free, make_engine


async def _finish(engine: AsyncLLMEngine, request_id: str) -> str | None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    last = None
    async for out in engine.generate([5, 6, 7], params, request_id):
        last = out
    return last.finish_reason if last else None


def test_failed_steps_in_a_row_make_the_replica_unhealthy(tiny_model):
    async def main():
        engine = make_engine(tiny_model)
        args = HealthArgs(max_failed_steps=3)
        assert await _finish(engine, "ok") == "length"
        assert health_problem(engine, args) is None
        runner = engine.engine.runner
        caches, runner.kv_caches = runner.kv_caches, []  # every forward now raises
        for i in range(2):
            assert await _finish(engine, f"bad{i}") == "error"
        assert health_problem(engine, args) is None  # two: not yet
        assert await _finish(engine, "bad2") == "error"
        assert health_problem(engine, args) == "3 engine steps in a row failed"
        runner.kv_caches = caches  # the device came back
        assert await _finish(engine, "again") == "length"
        assert health_problem(engine, args) is None
        assert_all_blocks_free(engine)
        await engine.shutdown()

    asyncio.run(main())


def test_a_step_running_past_step_timeout_makes_the_replica_unhealthy(tiny_model):
    async def main():
        engine = make_engine(tiny_model)
        args = HealthArgs(step_timeout_s=1e-9)
        request = asyncio.create_task(_finish(engine, "r"))
        seen = None
        while not request.done() and seen is None:  # the loop runs while the step does
            if engine.step_running_s > 0:
                seen = health_problem(engine, args)
            await asyncio.sleep(0)
        await request
        assert seen is not None and seen.startswith("an engine step has run")
        assert health_problem(engine, args) is None  # between steps
        await engine.shutdown()

    asyncio.run(main())
