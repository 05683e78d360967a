"""The weights on huge pages against the same weights on 4 KiB pages: one engine, the same
requests, the two placements alternating round by round.

    python -m loadtests.bench_host_memory [--model small] [--rounds 10] [--json]

The engine is built as it serves, its weights moved onto huge pages
(engine/cpu/host_memory.py); a copy of every weight on ordinary heap pages is made beside
them, and each round runs once on each placement (which goes first alternates). A round: a
128-token prompt's prefill step and its 63 decode steps at batch 1, then 32 requests decoding
together. Prints the medians of each side's step times and their ratio; greedy tokens must be
the same on both (they are the same bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.weight_slots import weight_slots
from loadtests.cpu_accounting import host_info
from loadtests.workload import resolve_model

PLACEMENTS = ("huge", "small")


def one_stream(engine: LLMEngine, prompt: list[int], tag: str) -> tuple[float, float, list[int]]:
    """The prefill step's seconds, the median decode step's, and the tokens."""
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    engine.add_request(tag, prompt, params)
    tokens: list[int] = []
    start = time.perf_counter()
    tokens += [t for out in engine.step() for t in out.new_token_ids]
    prefill = time.perf_counter() - start
    decode = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        tokens += [t for out in engine.step() for t in out.new_token_ids]
        decode.append(time.perf_counter() - start)
    return prefill, statistics.median(decode), tokens


def batch_decode(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """The median step of `prompts` decoding together, once every one has its first token."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    seen: set[str] = set()
    while len(seen) < len(prompts):
        seen.update(out.request_id for out in engine.step() if out.new_token_ids)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="tiny | small | a checkpoint dir")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args(argv)
    config = EngineConfig(
        model=resolve_model(opts.model),
        num_threads=opts.threads,
        cache=CacheConfig(block_size=16, kv_cache_bytes=1 << 30),
        scheduler=SchedulerConfig(
            max_num_seqs=opts.batch, max_num_batched_tokens=4096, max_model_len=1024
        ),
    )
    engine = LLMEngine(config)
    slots = weight_slots(engine.runner.model)
    huge = [slot.tensor for slot in slots]
    if len({t.untyped_storage().data_ptr() for t in huge}) != 1:
        sys.exit("the weights are not on huge pages here (transparent huge pages never?)")
    small = [t.clone() for t in huge]  # the heap: 4 KiB pages (glibc's threshold is raised)
    vocab = engine.runner.spec.vocab_size
    rng = random.Random(0)
    figures: dict[str, dict[str, list[float]]] = {p: {} for p in PLACEMENTS}
    for r in range(-1, opts.rounds):  # round -1 warms up both
        prompt = [rng.randrange(3, vocab) for _ in range(128)]
        prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(opts.batch)]
        tokens = {}
        for placement in PLACEMENTS if r % 2 == 0 else PLACEMENTS[::-1]:
            for slot, t in zip(slots, huge if placement == "huge" else small, strict=True):
                slot.put(t)
            prefill, decode, tokens[placement] = one_stream(engine, prompt, f"{placement}{r}")
            batch = batch_decode(engine, prompts, f"{placement}{r}b")
            if r >= 0:
                for name, s in (("prefill", prefill), ("decode", decode), ("batch", batch)):
                    figures[placement].setdefault(name, []).append(1e3 * s)
        if tokens["huge"] != tokens["small"]:
            sys.exit(f"round {r}: the two placements gave different tokens")
    for slot, t in zip(slots, huge, strict=True):
        slot.put(t)
    engine.close()
    medians = {p: {k: statistics.median(v) for k, v in f.items()} for p, f in figures.items()}
    result = {
        "model": opts.model,
        "rounds": opts.rounds,
        "batch": opts.batch,
        "threads": opts.threads,
        "weights_mib": sum(t.numel() * t.element_size() for t in small) >> 20,
        "torch": torch.__version__,
        "host": host_info(),
        "ms": medians,
        "huge_over_small": {k: medians["huge"][k] / medians["small"][k] for k in medians["huge"]},
    }
    if opts.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{opts.model}, {opts.rounds} rounds, step medians (ms):")
        label = {"prefill": "prefill 128", "decode": "decode b1", "batch": f"decode b{opts.batch}"}
        for name in medians["huge"]:
            print(
                f"  {label[name]:12} huge pages {medians['huge'][name]:8.2f}   4 KiB pages"
                f" {medians['small'][name]:8.2f}   ratio {result['huge_over_small'][name]:.3f}"
            )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
