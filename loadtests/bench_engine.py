"""Engine throughput on the standard workload: continuous vs static vs HF generate.

    python -m loadtests.bench_engine --model small [--json] [--hf-batch-sizes 8,32]

All figures come from the same run on the same machine (it is noisy: compare ratios).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.loader import DecoderSpec, read_spec
from engine.model.tiny_model import make_model
from loadtests.workload import WorkItem, load_workload

REPO = Path(__file__).resolve().parent.parent


def peak_gemm_flops(n: int = 2048, reps: int = 10) -> float:
    """Best FLOP/s of a large float32 matmul over several tries: the practical peak (best,
    not median, so that a noisy moment does not flatter roofline_frac)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times)


def workload_flops(spec: DecoderSpec, items: list[WorkItem]) -> float:
    """Model FLOPs the workload needs at the least: weights for every token, the vocab
    projection once per output token, and causal attention over each token's context."""
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    q = spec.num_heads * spec.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate_size
    weights_per_token = 2 * spec.num_layers * per_layer
    lm_head = 2 * h * spec.vocab_size
    attn_per_ctx = 4 * q * spec.num_layers  # QK^T and PV: 2 FLOPs per MAC, per context token
    total = 0.0
    for it in items:
        p, o = len(it.prompt_token_ids), it.max_tokens
        tokens = p + o - 1  # the last sampled token is never fed back
        total += tokens * weights_per_token + o * lm_head
        # Token at position i attends to i + 1 keys.
        total += attn_per_ctx * (tokens * (tokens + 1) / 2)
    return total


def run_engine(model_dir: str, items: list[WorkItem], batching: str, args) -> dict:
    config = EngineConfig(
        model=model_dir,
        num_threads=args.threads,
        cache=CacheConfig(block_size=args.block_size, kv_cache_bytes=int(args.kv_cache_gb * 2**30)),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=1024,
            batching=batching,
        ),
    )
    engine = LLMEngine(config)
    for it in items:
        params = SamplingParams(temperature=0.0, max_tokens=it.max_tokens, ignore_eos=True)
        engine.add_request(it.request_id, it.prompt_token_ids, params)
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced += len(out.new_token_ids)
    wall = time.perf_counter() - start
    expected = sum(it.max_tokens for it in items)
    if produced != expected:
        raise RuntimeError(f"{batching}: produced {produced} tokens, expected {expected}")
    engine.scheduler.check_integrity()
    return {
        "tok_s": produced / wall,
        "wall_s": wall,
        "outside_forward_frac": 1.0 - engine.runner.forward_seconds / wall,
        "steps": engine.scheduler.num_steps_total,
        "preemptions": engine.scheduler.num_preemptions_total,
    }


def run_hf_static(model_dir: str, items: list[WorkItem], batch_size: int) -> dict:
    """HF generate in static batches with left padding; counts each request's own tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0
    produced = 0
    start = time.perf_counter()
    for b in range(0, len(items), batch_size):
        batch = items[b : b + batch_size]
        width = max(len(it.prompt_token_ids) for it in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, it in enumerate(batch):
            n = len(it.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(it.prompt_token_ids)
            mask[i, width - n :] = 1
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(it.max_tokens for it in batch),
                eos_token_id=None,
                pad_token_id=pad,
            )
        produced += sum(it.max_tokens for it in batch)
    wall = time.perf_counter() - start
    return {"tok_s": produced / wall, "wall_s": wall}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="tiny, small, or a checkpoint dir")
    parser.add_argument("--workload", default="mixed-200")
    parser.add_argument("--num-requests", type=int, default=None, help="first N requests only")
    parser.add_argument("--hf-batch-sizes", default="32")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--static-max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-gb", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = args.model
    if args.model in ("tiny", "small"):
        model_dir = str(make_model(REPO / "models" / args.model, size=args.model))
    spec = read_spec(model_dir)
    items = load_workload(args.workload, spec.vocab_size, seed=0, limit=args.num_requests)
    peak_before = peak_gemm_flops()
    flops = workload_flops(spec, items)

    result: dict = {
        "model": args.model,
        "workload": args.workload,
        "num_requests": len(items),
        "output_tokens": sum(it.max_tokens for it in items),
        "threads": torch.get_num_threads(),
    }
    cont = run_engine(model_dir, items, "continuous", args)
    peak = max(peak_before, peak_gemm_flops())  # measured on both sides of the engine run
    result["peak_gemm_gflop_s"] = peak / 1e9
    result["continuous_tok_s"] = cont["tok_s"]
    result["continuous_wall_s"] = cont["wall_s"]
    result["outside_forward_frac"] = cont["outside_forward_frac"]
    result["preemptions"] = cont["preemptions"]
    result["roofline_frac"] = flops / cont["wall_s"] / peak
    if not args.skip_static:
        static_args = argparse.Namespace(**{**vars(args), "max_num_seqs": args.static_max_num_seqs})
        static = run_engine(model_dir, items, "static", static_args)
        result["static_tok_s"] = static["tok_s"]
        result["speedup_vs_static"] = cont["tok_s"] / static["tok_s"]
    if not args.skip_hf:
        hf = {}
        for bs in [int(x) for x in args.hf_batch_sizes.split(",")]:
            hf[bs] = run_hf_static(model_dir, items, bs)["tok_s"]
            result[f"hf_static_bs{bs}_tok_s"] = hf[bs]
        best = max(hf, key=hf.get)
        result["hf_static_tok_s"] = hf[best]
        result["hf_static_best_batch_size"] = best
        result["speedup_vs_hf_static"] = cont["tok_s"] / hf[best]

    if args.json:
        print(json.dumps(result))
    else:
        width = max(len(k) for k in result)
        for key, value in result.items():
            shown = f"{value:.3f}" if isinstance(value, float) else value
            print(f"{key:<{width}}  {shown}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
