"""Decode and prefill speed of quantized weights against each format's memory roofline.

    python -m loadtests.bench_quant --model DIR [--awq DIR] [--fp8 DIR] --device cuda \\
        --dtype bfloat16 [--batches 1,32,128] [--json]

Variants: the float checkpoint (`--model`), FP8 (`--fp8` DIR, else `--model` quantized per
channel while loading) and, with `--awq`, an AWQ INT4 checkpoint of the same shape (the GPU
stage makes random ones: engine/model/random_checkpoint.py --quant). For each: the weights'
bytes on the device, the GPU self-check's verdicts, the median decode step at each batch size
beside its roofline (weight bytes + the KV bytes the step reads, over the device's measured
read bandwidth), and prefill tokens/s of full steps (--prefill-tokens, 4096). All from the same run.
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
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.loader import read_spec
from loadtests.peaks import peak_read_bandwidth

PREFILL_REQUESTS = 8


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _engine(model: str, quantization: str | None, args) -> LLMEngine:
    max_len = args.prompt_len + args.steps + 16
    return LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            quantization=quantization,
            cache=CacheConfig(
                block_size=16,
                kv_cache_bytes=int(args.kv_cache_gb * 2**30),
                enable_prefix_caching=False,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max(max(args.batches), PREFILL_REQUESTS),
                max_num_batched_tokens=max(args.prefill_tokens, args.prompt_len),
                max_model_len=max(max_len, args.prefill_tokens // PREFILL_REQUESTS + 2),
            ),
        )
    )


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _decode(engine: LLMEngine, batch: int, args, rng: random.Random, vocab: int) -> float:
    """Median seconds of a decode step with `batch` requests in it."""
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, _prompts(rng, batch, args.prompt_len, vocab), strict=True):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # every prompt prefilled: the steps after are decode-only
        started.update(out.request_id for out in engine.step())
    times = []
    for _ in range(args.steps):
        _sync(args.device)
        start = time.perf_counter()
        engine.step()
        _sync(args.device)
        times.append(time.perf_counter() - start)
    engine.abort(ids)
    engine.step()
    return statistics.median(times)


def _prefill(engine: LLMEngine, args, rng: random.Random, vocab: int) -> float:
    """Prompt tokens/s of steps that prefill `--prefill-tokens` tokens of fresh prompts."""
    length = args.prefill_tokens // PREFILL_REQUESTS
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rates = []
    for round_ in range(3):
        for i, prompt in enumerate(_prompts(rng, PREFILL_REQUESTS, length, vocab)):
            engine.add_request(f"p{round_}-{i}", prompt, params)
        _sync(args.device)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        _sync(args.device)
        rates.append(length * PREFILL_REQUESTS / (time.perf_counter() - start))
    return max(rates)


def run_variant(name: str, model: str, quantization: str | None, args, bandwidth: float) -> dict:
    vocab = read_spec(model).vocab_size
    engine = _engine(model, quantization, args)
    runner = engine.runner
    weights = runner.weight_bytes()
    kv_per_token = runner.bytes_per_block() / runner.block_size
    rng = random.Random(0)
    decode = {}
    for batch in args.batches:
        step = _decode(engine, batch, args, rng, vocab)
        context = args.prompt_len + args.steps // 2
        roofline = (weights + batch * context * kv_per_token) / bandwidth
        decode[str(batch)] = {
            "step_ms": step * 1e3,
            "roofline_ms": roofline * 1e3,
            "roofline_frac": roofline / step,
            "tok_s": batch / step,
        }
    return {
        "variant": name,
        "weights_gib": weights / 2**30,
        "self_check": [(c.part, c.result, c.reason) for c in runner.self_check],
        "decode": decode,
        "prefill_tok_s": _prefill(engine, args, rng, vocab),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the float checkpoint")
    parser.add_argument("--fp8", default=None, help="an FP8 checkpoint (default: online fp8)")
    parser.add_argument("--awq", default=None, help="an AWQ checkpoint of the same shape")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill-tokens", type=int, default=4096, help="per prefill step")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    bandwidth = peak_read_bandwidth(device=args.device)
    variants = [("float", args.model, None)]
    variants.append(("fp8", args.fp8, None) if args.fp8 else ("fp8 (online)", args.model, "fp8"))
    if args.awq:
        variants.append(("awq int4", args.awq, None))
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "variants": [run_variant(*v, args, bandwidth) for v in variants],
    }
    if args.json:
        json.dump(result, sys.stdout)
        print()
        return result
    print(f"{result['device']}: read bandwidth {result['read_bandwidth_gb_s']:.0f} GB/s")
    for v in result["variants"]:
        print(
            f"{v['variant']}: weights {v['weights_gib']:.2f} GiB, prefill "
            f"{v['prefill_tok_s']:,.0f} tok/s, self-check {v['self_check']}"
        )
        for batch, d in v["decode"].items():
            print(
                f"  batch {batch}: {d['step_ms']:.2f} ms/step (roofline {d['roofline_ms']:.2f} "
                f"ms, {d['roofline_frac']:.0%}), {d['tok_s']:,.0f} tok/s"
            )


if __name__ == "__main__":
    main()
