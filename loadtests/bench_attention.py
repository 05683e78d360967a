"""Attention backends head to head: decode attention alone and the whole decode step at
several batch sizes over fixed-length contexts, against the memory roofline; prefill
tokens/s of one chunk against the matmul peak. The `torch` backend is the old path.

    python -m engine.model.random_checkpoint --shape llama3-8b --out /tmp/llama3-8b --device cuda
    python -m loadtests.bench_attention --model /tmp/llama3-8b --device cuda --dtype bfloat16

Every figure is a median over `--reps` timed runs after warm-up, with the roofline (bytes
the step must read / this device's measured read bandwidth; FLOPs / its measured matmul peak)
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from functools import partial

import torch

from engine.attention.registry import AttentionShape, get_attention_backend
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.errors import InvalidParam
from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.runner.torch_runner import TorchModelRunner
from loadtests.peaks import peak_gemm_flops, peak_read_bandwidth, timed


def _median_s(fn, device: str, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device) for _ in range(reps))


def _step(runner: TorchModelRunner, lengths: list[tuple[int, int]], seed: int):
    """(cached, new) tokens per request over scattered blocks -> the runner's packed inputs."""
    bs = runner.block_size
    blocks = list(range(runner.num_kv_blocks()))
    random.Random(seed).shuffle(blocks)
    order, used = [], 0
    for i, (cached, new) in enumerate(lengths):
        n = -(-(cached + new) // bs)
        order.append(
            ScheduledRequest(
                f"r{i}", [1] * new, cached, blocks[used : used + n], True, SamplingParams(), 0
            )
        )
        used += n
    return runner.prepare_inputs(order)


def _forward(runner: TorchModelRunner, backend, ids, positions, layout, logits_at) -> None:
    """One step as the runner takes it: the backend's per-step prepare, then the forward."""
    metadata = backend.prepare(layout)
    runner.model(ids, positions, runner.kv_caches, backend, metadata, logits_at)


def _kv_bytes_per_token(runner: TorchModelRunner) -> int:
    return runner.bytes_per_block() // runner.block_size  # every layer's K and V


def _matmul_flops(runner: TorchModelRunner, tokens: int) -> float:
    s = runner.spec
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_layer = s.hidden_size * (2 * q + 2 * kv) + 3 * s.hidden_size * s.intermediate_size
    attention = 2 * q * tokens * (tokens + 1)  # causal QK^T and PV, 2 FLOPs per MAC
    return s.num_layers * (2 * per_layer * tokens + attention) + 2 * s.hidden_size * s.vocab_size


def bench(args: argparse.Namespace) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    bs = args.block_size
    per_request = -(-(args.context + 1) // bs)
    num_blocks = max(max(batches) * per_request, -(-args.prefill_chunk // bs)) + 1
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        attention_backend="torch",
        cache=CacheConfig(block_size=bs, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_seqs=max(batches), max_num_batched_tokens=args.prefill_chunk
        ),
    )
    runner = TorchModelRunner(config)
    device, spec = args.device, runner.spec
    bandwidth = peak_read_bandwidth(device=device)
    matmul_peak = peak_gemm_flops(device=device, dtype=args.dtype)
    weights = runner.weight_bytes()
    shape = AttentionShape(runner.device.type, args.dtype, spec.head_dim, bs)
    scale = spec.head_dim**-0.5
    rows = []
    for name in args.backends.split(","):
        try:
            backend, reason = get_attention_backend(name, shape)
        except InvalidParam as exc:  # not installed here, or not for this shape
            rows.append({"backend": name, "kind": "skipped", "reason": str(exc)})
            continue
        runner.backend = backend
        k_cache, v_cache = runner.kv_caches[0]
        for batch in batches:
            ids, positions, layout, logits_at = _step(runner, [(args.context, 1)] * batch, batch)
            q = torch.randn(batch, spec.num_heads, spec.head_dim, device=device).to(runner.dtype)
            k = torch.randn(batch, spec.num_kv_heads, spec.head_dim, device=device)
            k = k.to(runner.dtype)
            metadata = backend.prepare(layout)
            attention = partial(backend.forward, q, k, k, k_cache, v_cache, metadata, scale)
            step = partial(_forward, runner, backend, ids, positions, layout, logits_at)
            kv_read = batch * (args.context + 1) * _kv_bytes_per_token(runner)
            attention_s = _median_s(attention, device, args.reps)
            step_s = _median_s(step, device, args.reps)
            attention_floor = kv_read / spec.num_layers / bandwidth
            step_floor = (weights + kv_read) / bandwidth
            rows.append(
                {
                    "backend": name,
                    "kind": "decode",
                    "batch": batch,
                    "context": args.context,
                    "attention_us": attention_s * 1e6,
                    "attention_vs_roofline": attention_s / attention_floor,
                    "step_ms": step_s * 1e3,
                    "step_vs_roofline": step_s / step_floor,
                }
            )
        ids, positions, layout, logits_at = _step(runner, [(0, args.prefill_chunk)], 0)
        prefill = partial(_forward, runner, backend, ids, positions, layout, logits_at)
        prefill_s = _median_s(prefill, device, args.reps)
        rows.append(
            {
                "backend": name,
                "reason": reason,
                "kind": "prefill",
                "chunk": args.prefill_chunk,
                "tokens_per_s": args.prefill_chunk / prefill_s,
                "vs_matmul_peak": _matmul_flops(runner, args.prefill_chunk)
                / prefill_s
                / matmul_peak,
            }
        )
    return {
        "model": args.model,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "dtype": args.dtype,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "matmul_peak_tflops": matmul_peak / 1e12,
        "weight_gb": weights / 1e9,
        "rows": rows,
    }


def _print(result: dict) -> None:
    print(
        f"{result['device']} {result['dtype']}: read {result['read_bandwidth_gb_s']:.0f} GB/s, "
        f"matmul {result['matmul_peak_tflops']:.1f} TFLOP/s, weights {result['weight_gb']:.2f} GB"
    )
    print("backend     batch  attention us  x roofline   step ms  x roofline")
    for r in result["rows"]:
        if r["kind"] == "decode":
            print(
                f"{r['backend']:<10} {r['batch']:>6} {r['attention_us']:>13.1f} "
                f"{r['attention_vs_roofline']:>11.2f} {r['step_ms']:>9.2f} "
                f"{r['step_vs_roofline']:>11.2f}"
            )
    for r in result["rows"]:
        if r["kind"] == "skipped":
            print(f"{r['backend']:<10} skipped: {r['reason']}")
        if r["kind"] == "prefill":
            print(
                f"{r['backend']:<10} prefill {r['chunk']} tokens: {r['tokens_per_s']:,.0f} tok/s, "
                f"{r['vs_matmul_peak']:.2f} of the matmul peak"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backends", default="torch,triton,flashinfer")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with torch.inference_mode():
        result = bench(args)
    print(json.dumps(result, indent=2)) if args.json else _print(result)


if __name__ == "__main__":
    main()
