"""Offline demo of the engine: a few prompts served together, streamed step by step.

python -m engine.demo --model models/tiny
"""

from __future__ import annotations

import argparse
import time

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model))
    prompts = ["Hello, world.", "The quick brown fox", "Café au lait", "def step(self):"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, res in zip(prompts, results, strict=True):
        print(f"{prompt!r} -> {res.text!r} ({len(res.token_ids)} tokens, {res.finish_reason})")
    total = sum(len(r.token_ids) for r in results)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.0f} tokens/s)")


if __name__ == "__main__":
    main()
