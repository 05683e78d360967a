"""Our engine alone, in process, at `vllm bench serve`'s 64-stream shape: 128 prompts of 256
random token ids, 128 tokens out each (ignore_eos, greedy), 64 at a time; prints tokens/s
and the cores the process used. Run with the app's processes stopped (or none running);
engine_c64_vllm.py is vLLM's engine on the same shape.

  .venv/bin/python reports/serving/cpu-host-2026-12-07-s64/engine_c64_ours.py
  GOMP_SPINCOUNT=1000 .venv/bin/python ...   (libgomp spinning less: session 64, not kept)
"""

import asyncio
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from loadtests.serve_bench import deploy_args  # noqa: E402

model = {"model": str(REPO / "models" / "small"), "served_model_name": "small"}
args = deploy_args(str(REPO / "deploy.yaml"), model)
rng = random.Random(3)


async def main() -> None:
    engine = AsyncLLMEngine.built(lambda: LLMEngine(args.engine.engine_config(args.model)))
    gate = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        prompt = [rng.randrange(16, 16000) for _ in range(256)]
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        async with gate:
            async for _ in engine.generate(prompt, params, f"r{i}"):
                pass

    await one(-1)  # a warm-up
    start, before = time.perf_counter(), os.times()
    await asyncio.gather(*(one(i) for i in range(128)))
    wall, after = time.perf_counter() - start, os.times()
    cpu = after.user - before.user + after.system - before.system
    print(f"wall {wall:.1f} s, {128 * 128 / wall:.1f} tok/s, {cpu / wall:.2f} cores")
    await engine.shutdown()


asyncio.run(main())
