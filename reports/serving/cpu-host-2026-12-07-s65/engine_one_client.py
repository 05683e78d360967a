"""The one-client chat of one_client.py (session 64) with the engine alone in this process:
deploy.yaml's engine args, the `small` model, the chat template applied as the ingress does;
N requests one at a time, each after a short pause; prints the median TTFT and TPOT, ms.

  .venv/bin/python reports/serving/cpu-host-2026-12-07-s65/engine_one_client.py 30
"""

import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import yaml

from engine.async_engine import AsyncLLMEngine
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from serve_app.config import AppArgs

REPO = Path(__file__).resolve().parents[3]


def deploy_engine() -> AsyncLLMEngine:
    """deploy.yaml's engine with the `small` model, in this process."""
    app = yaml.safe_load((REPO / "deploy.yaml").read_text())["applications"][0]["args"]
    app |= {"model": str(REPO / "models" / "small"), "served_model_name": "small"}
    args = AppArgs.model_validate(app)
    return AsyncLLMEngine.built(lambda: LLMEngine(args.engine.engine_config(args.model)))


async def one_chat(engine: AsyncLLMEngine, text: str, request_id: str) -> tuple[float, float, int]:
    """TTFT and TPOT (ms) and the prompt's length of one chat of `text`, the chat template
    applied as the ingress does."""
    tok = engine.engine.tokenizer
    messages = [{"role": "user", "content": text}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(chat, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    start, first = time.perf_counter(), None
    async for out in engine.generate(prompt, params, request_id):
        if out.new_token_ids and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first - start) * 1e3, (end - first) * 1e3 / 63, len(prompt)


async def main(n: int) -> None:
    engine = deploy_engine()
    tok = engine.engine.tokenizer
    rng = random.Random(time.time_ns())
    rows = []
    for i in range(n + 3):
        ids = [rng.randrange(1000, tok.vocab_size - 100) for _ in range(128)]
        await asyncio.sleep(0.3)  # as the HTTP client's chats come: not back to back
        row = await one_chat(engine, tok.decode(ids), f"r{i}")
        if i >= 3:
            rows.append(row)
    print(
        f"engine alone: TTFT {statistics.median(r[0] for r in rows):.1f} "
        f"TPOT {statistics.median(r[1] for r in rows):.2f} "
        f"(prompts of {min(r[2] for r in rows)}-{max(r[2] for r in rows)} tokens)"
    )
    await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
