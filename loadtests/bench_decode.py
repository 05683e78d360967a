"""Steady decode: a full batch of requests decoding, step after step. How busy the device is
(idle fraction), tokens/s, with steps overlapped or not and (CUDA) decode graphs on or off;
and the sampler alone on a batch of logits (its draw by the CUDA kernel's search and by
sort).

    python -m loadtests.bench_decode --model small --batch 64 [--json]
    python -m loadtests.bench_decode --model <8B dir> --device cuda --dtype bfloat16 --batch 256
    python -m loadtests.bench_decode --frequency-penalty 0.5 --logprobs 2  # rows of every kind

Each variant is a fresh engine on the same requests; greedy variants must produce the same
tokens. All figures come from the same run (compare ratios on noisy machines).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.loader import read_spec
from engine.sampling.sampler import Sampler
from engine.sampling.token_draw import draw_by_search, draw_by_sort
from loadtests.workload import resolve_model


def variants(device: str) -> dict[str, dict]:
    """Engine settings per variant: overlap on/off, and on CUDA decode graphs on/off."""
    if device != "cuda":
        return {"sync": {"overlap_steps": False}, "overlap": {"overlap_steps": True}}
    return {
        "eager_sync": {"overlap_steps": False, "enforce_eager": True},
        "eager_overlap": {"overlap_steps": True, "enforce_eager": True},
        "graphs_sync": {"overlap_steps": False, "enforce_eager": False},
        "graphs_overlap": {"overlap_steps": True, "enforce_eager": False},
    }


def run_variant(model_dir: str, args, settings: dict, prompts: list[list[int]]) -> dict:
    total_steps = args.warmup_steps + args.steps
    config = EngineConfig(
        model=model_dir,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads,
        cache=CacheConfig(block_size=16, kv_cache_bytes=int(args.kv_cache_gb * 2**30)),
        scheduler=SchedulerConfig(
            max_num_seqs=args.batch,
            max_num_batched_tokens=max(2048, args.prompt_len),
            max_model_len=args.prompt_len + total_steps + args.batch + 8,
        ),
        **settings,
    )
    engine = LLMEngine(config)
    sampling = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "frequency_penalty": args.frequency_penalty,
        "logprobs": args.logprobs,
    }
    run = steady_decode(engine, prompts, args.warmup_steps, args.steps, sampling)
    engine.close()
    return run


def steady_decode(
    engine: LLMEngine,
    prompts: list[list[int]],
    warmup_steps: int,
    steps: int,
    sampling: dict | None = None,
    tag: str = "",
) -> dict:
    """`prompts` decoding together on `engine` (which must admit them all at once and hold
    each prompt plus `warmup_steps + steps + len(prompts) + 1` tokens): after every prefill
    and `warmup_steps` decode steps, `steps` steps timed, then the requests are aborted.
    Returns tokens/s, the time of a step, the device's idle share and the share of steps
    launched before the previous one was collected; `tokens` by request."""
    batch = len(prompts)
    ids = [f"{tag}{i}" for i in range(batch)]
    # Requests prefilled early decode while the others prefill (at most a step each): none
    # may end before the timed steps do, or their batch would shrink under the clock.
    max_tokens = 1 + warmup_steps + steps + batch
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **(sampling or {}))
        engine.add_request(ids[i], prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> int:
        outputs = engine.step()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        return sum(len(out.new_token_ids) for out in outputs)

    # Prefill everything, then a few decode steps to warm up.
    while engine.stats().num_decoding < batch:
        step()
    for _ in range(warmup_steps):
        step()
    clock = engine.runner.device_clock
    if engine.config.device == "cuda":
        torch.cuda.synchronize()
    busy_before, start, produced = clock.seconds, time.perf_counter(), 0
    steps_before = engine.scheduler.num_steps_total
    continued_before = engine.core.num_continuations
    for _ in range(steps):
        produced += step()
    wall = time.perf_counter() - start
    busy = clock.seconds - busy_before
    num_steps = engine.scheduler.num_steps_total - steps_before
    continued = engine.core.num_continuations - continued_before
    engine.abort(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "tok_s": produced / wall,
        "step_ms": 1e3 * wall * batch / produced,
        "device_idle_frac": max(0.0, 1.0 - busy / wall),
        "launched_ahead_frac": continued / max(num_steps, 1),
        "tokens": {rid.removeprefix(tag): t for rid, t in tokens.items()},
    }


def same_tokens(runs: list[dict[str, list[int]]]) -> bool:
    """Whether the runs' tokens agree, each request's up to the fewest any run has (a run
    that launched a step ahead has one step more when its requests are aborted)."""
    first = runs[0]
    for rid, ours in first.items():
        n = min(len(run[rid]) for run in runs)
        if any(run[rid][:n] != ours[:n] for run in runs):
            return False
    return True


def median_ms(fn, device: str, repeats: int) -> float:
    """Median ms of `fn()` over `repeats` calls after 3 warm-up calls, waiting for the device."""
    times = []
    for i in range(repeats + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_sampler(args, vocab_size: int) -> dict:
    """Median ms of one step's sampling: `--batch` rows at temperature 1.0 / top_p 0.9; and of
    the draw alone, by the CUDA kernel's search and by the sort that defines it."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    sampler = Sampler(0)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16)
    rows = [
        ScheduledRequest(str(i), [1], 10, [0], True, params, 3, (), None, None)
        for i in range(args.batch)
    ]
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(args.batch, vocab_size, generator=generator, device=device, dtype=dtype)
    repeats = args.sampler_repeats
    figures = {
        "sampler_ms_t1_top_p0.9": median_ms(
            lambda: sampler.draw(logits, rows)[0].tolist(), args.device, repeats
        )
    }
    u = torch.rand(args.batch, generator=generator, device=device)
    params_list = [params] * args.batch
    figures["draw_sort_ms"] = median_ms(
        lambda: draw_by_sort(logits, params_list, u), args.device, repeats
    )
    if args.device == "cuda":
        figures["draw_search_ms"] = median_ms(
            lambda: draw_by_search(logits, params_list, u), args.device, repeats
        )
        figures["draw_search_vs_sort"] = figures["draw_sort_ms"] / figures["draw_search_ms"]
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="tiny, small, or a checkpoint dir")
    parser.add_argument("--batch", type=int, default=64, help="requests decoding at once")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40, help="decode steps measured")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--sampler-repeats", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    model_dir = resolve_model(args.model)
    vocab_size = read_spec(model_dir).vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(args.prompt_len)] for _ in range(args.batch)
    ]
    result: dict = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "frequency_penalty": args.frequency_penalty,
        "logprobs": args.logprobs,
    }
    runs = {
        name: run_variant(model_dir, args, s, prompts) for name, s in variants(args.device).items()
    }
    result["outputs_identical"] = same_tokens([r["tokens"] for r in runs.values()])
    for name, run in runs.items():
        for key in ("tok_s", "step_ms", "device_idle_frac", "launched_ahead_frac"):
            result[f"{name}_{key}"] = run[key]
    base = "graphs_sync" if args.device == "cuda" else "sync"
    for name in runs:
        if name != base:
            result[f"{name}_vs_{base}"] = runs[name]["tok_s"] / runs[base]["tok_s"]
    result.update(time_sampler(args, vocab_size))
    if args.json:
        print(json.dumps(result))
    else:
        width = max(len(k) for k in result)
        for key, value in result.items():
            print(
                f"{key:<{width}}  {value:.3f}"
                if isinstance(value, float)
                else f"{key:<{width}}  {value}"
            )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
