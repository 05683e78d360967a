"""Quantized weights and an FP8 KV cache in the simulator: what they do to the KV cache, to
the memory-aware rule's batch, to throughput and to capacity at the SLO.

    python -m loadtests.bench_quant_sim [--quick] [--json]

Settings: Llama-3.1-8B on one H100-80GB and Llama-2-13B on one A100-40GB, each as bfloat16,
bfloat16 with an FP8 KV cache, FP8 weights with an FP8 KV cache, and INT4 (AWQ/GPTQ) weights
with an FP8 KV cache. For each:
the KV cache in tokens (what gpu_memory_fraction 0.9 holds after the weights), throughput of
the memory-aware policy on a saturating chat trace with the mean max_num_seqs the rule chose,
and capacity (the highest Poisson rate at which >= 90% of requests meet the SLO). Ratios are
against bfloat16 in the same run. The cost model's roofline (engine/runner/cost_model.py)
prices each variant: fewer weight and KV bytes per step, FP8 GEMMs at the FP8 peak where the
GPU has one (Hopper, not Ampere).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cluster.batching import Bounds, MemoryAwareConfig, SlaConfig
from cluster.request_records import Slo
from cluster.sim_config import SimConfig
from cluster.simulator import Simulator, capacity
from cluster.workload import CHAT_OUTPUT, CHAT_PROMPT, make_workload
from engine.core.config import CacheConfig, SchedulerConfig
from engine.runner.cost_model import GPUS, MODELS

# (setting, model, GPU, saturating rate in requests/s)
SETTINGS = [
    ("Llama-3.1-8B, 1x H100-80GB", "Llama-3.1-8B", "H100-80GB", 150.0),
    ("Llama-2-13B, 1x A100-40GB", "Llama-2-13B", "A100-40GB", 12.0),
]
# (variant, weights, kv_cache_dtype)
VARIANTS = [
    ("bf16", None, "auto"),
    ("bf16 + fp8 KV", None, "fp8_e4m3"),
    ("fp8 weights + fp8 KV", "fp8", "fp8_e4m3"),
    ("int4 weights + fp8 KV", "int4", "fp8_e4m3"),
]


def config_for(model: str, gpu: str, weights: str | None, kv: str) -> SimConfig:
    bounds = Bounds(4, 1024)
    return SimConfig(
        model=MODELS[model].quantized(weights),
        gpu=GPUS[gpu],
        policy="memory_aware",
        scheduler=SchedulerConfig(
            max_num_seqs=1024, max_num_batched_tokens=4096, max_model_len=4096
        ),
        cache=CacheConfig(kv_cache_bytes=None, enable_prefix_caching=False, kv_cache_dtype=kv),
        memory_aware=MemoryAwareConfig(eta=0.95, bounds=bounds),
        sla=SlaConfig(target_s=0.08, eps_s=0.01, bounds=bounds),
        slo=Slo(ttft_s=2.0, itl_s=0.1),
    )


def run(num_requests: int, capacity_seconds: float, iters: int) -> dict[str, Any]:
    rows = []
    for setting, model, gpu, rate in SETTINGS:
        trace = make_workload(num_requests, rate, "poisson", CHAT_PROMPT, CHAT_OUTPUT, seed=0)

        def make_trace(r: float, _s: float = capacity_seconds):
            n = max(100, int(r * _s))
            return make_workload(n, r, "poisson", CHAT_PROMPT, CHAT_OUTPUT, seed=1)

        base: dict[str, float] = {}
        for variant, weights, kv in VARIANTS:
            config = config_for(model, gpu, weights, kv)
            result = Simulator(config).run(trace)
            summary = result.summary()
            chosen = [n for _, n in result.max_num_seqs_series] or [0]
            row = {
                "setting": setting,
                "variant": variant,
                "weights_gib": config.model.weight_bytes / 2**30,
                "kv_tokens": result.num_kv_blocks * config.cache.block_size,
                "mean_max_num_seqs": sum(chosen) / len(chosen),
                "mean_batch_size": summary["mean_batch_size"],
                "output_tok_s": summary["output_tok_s"],
                "capacity_rps": capacity(config, make_trace, iters=iters),
            }
            if not base:
                base = row
            for key in ("kv_tokens", "output_tok_s", "capacity_rps"):
                row[f"{key}_vs_bf16"] = row[key] / base[key] if base[key] else float("nan")
            rows.append(row)
    return {"rows": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| setting | variant | weights GiB | KV tokens | x bf16 | memory-aware max_num_seqs "
        "(mean) | mean batch | output tok/s | x bf16 | capacity req/s | x bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['setting']} | {r['variant']} | {r['weights_gib']:.1f} | {r['kv_tokens']:,} "
            f"| {r['kv_tokens_vs_bf16']:.2f} | {r['mean_max_num_seqs']:.0f} "
            f"| {r['mean_batch_size']:.0f} | {r['output_tok_s']:,.0f} "
            f"| {r['output_tok_s_vs_bf16']:.2f} | {r['capacity_rps']:.2f} "
            f"| {r['capacity_rps_vs_bf16']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke runs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        result = run(num_requests=150, capacity_seconds=20.0, iters=2)
    else:
        result = run(num_requests=1500, capacity_seconds=120.0, iters=5)
    if args.json:
        json.dump(result, sys.stdout)
        print()
    else:
        print(markdown(result))


if __name__ == "__main__":
    main()
