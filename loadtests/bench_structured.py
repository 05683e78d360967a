"""What structured outputs cost: engine throughput on the standard workload with every other
request held to a JSON schema against none, alternated rounds; and grammar compile times.

    python -m loadtests.bench_structured --model small --num-requests 100 [--repeat 2] [--json]

So that both runs make the same tokens, the constrained requests' schema is one long string
field whose closing quote is biased away (`logit_bias` -100, on every request of both runs):
they run to max_tokens like the others, each step filling and applying their bitmask.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.llm_engine import LLMEngine
from engine.model.loader import read_spec
from loadtests.json_schemas import random_schema
from loadtests.workload import WorkItem, load_workload, resolve_model

LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def run(engine: LLMEngine, items: list[WorkItem], every: int, quote: int) -> float:
    """Output tokens/s over `items`; every `every`-th request (0: none) carries the schema."""
    spec = StructuredOutput("json", json.dumps(LONG_TEXT))
    for i, it in enumerate(items):
        constrained = every and i % every == 0
        params = SamplingParams(
            temperature=0.0,
            max_tokens=it.max_tokens,
            ignore_eos=True,
            logit_bias={quote: -100.0},  # every request: the bias's own cost is not counted
            structured=spec if constrained else None,
        )
        engine.add_request(f"{every}-{it.request_id}", it.prompt_token_ids, params)
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    wall = time.perf_counter() - start
    expected = sum(it.max_tokens for it in items)
    if produced != expected:
        raise RuntimeError(f"produced {produced} tokens, expected {expected}")
    return produced / wall


def compile_times_ms(engine: LLMEngine, count: int) -> list[float]:
    """Milliseconds to compile each of `count` random schemas (first sight: no cache hit)."""
    rng = random.Random(1)
    bank = engine.grammar_bank()
    times = []
    for _ in range(count):
        spec = StructuredOutput("json", json.dumps(random_schema(rng)))
        start = time.perf_counter()
        bank.compile(spec)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="tiny, small, or a checkpoint dir")
    parser.add_argument("--workload", default="mixed-200")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=1, help="alternated rounds; medians")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    items = load_workload(args.workload, read_spec(model).vocab_size, limit=args.num_requests)
    config = EngineConfig(
        model=model,
        num_threads=args.threads,
        cache=CacheConfig(kv_cache_bytes=4 << 30, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=256, max_model_len=1024),
    )
    engine = LLMEngine(config)
    quote = engine.tokenizer.convert_tokens_to_ids('"')
    rounds = []
    for i in range(args.repeat):  # the order alternates: neither run always goes first
        runs = {every: 0.0 for every in ((0, 2) if i % 2 == 0 else (2, 0))}
        for every in runs:
            runs[every] = run(engine, items, every, quote)
        plain, half = runs[0], runs[2]
        rounds.append({"plain_tok_s": plain, "half_schema_tok_s": half, "ratio": half / plain})
    times = compile_times_ms(engine, 100)
    result = {
        "model": args.model,
        "num_requests": len(items),
        **{key: statistics.median(r[key] for r in rounds) for key in rounds[0]},
        "compile_ms_median": statistics.median(times),
        "compile_ms_max": max(times),
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            if key != "rounds":
                shown = f"{value:.3f}" if isinstance(value, float) else value
                print(f"{key:<20} {shown}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
