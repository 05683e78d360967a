"""Two variants of the CPU decoder on the standard workload, paired step by step.

    python -m loadtests.ab_decode_layout --model small [--pair NEW,BASE] [--num-requests N]
        [--json]

Variants: `feature_major` (the default build: feature-major steps and the native GEMM as
far as this host's build takes them, native prefill attention), `feature_major_mkl`
(feature-major steps up to 512 tokens, every GEMM through MKL), `sdpa_prefill` (the default
build with prefill attention through torch's SDPA), `torch_transpose` (the default build with
torch's copies between the token-major and feature-major layouts), `avx2_prefill` (the
default build with the AVX2 prefill attention kernel, on an AVX-512 host),
`row_major_weights` (the default build with the GEMM weights row-major instead of the W16
layout), `row_grains` (the GEMM's threads split W's rows only, not X's chunks),
`padded_panels` (no narrower tail panel: a batch's last 1-16 columns past a multiple of 32
padded to a wide panel), `token_major` (no feature-major steps).
The default pair is feature_major,token_major. Two engines (one per variant) run the same
requests with the same schedule and take turns, one step each, so both see the same state
of this noisy, shared machine. Prints the time
each spent in prefill-phase steps (some prompt still being prefilled) and decode-only steps,
tokens/s, and how many requests came out token-identical (greedy; a float32 near-tie may
flip one, see the oracle tests).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from engine.attention.native import load_native_prefill
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.decoder import FEATURE_MAJOR_MAX_TOKENS
from engine.model.fused import load_gemm
from engine.model.loader import read_spec
from loadtests.cpu_accounting import host_info
from loadtests.workload import WorkItem, load_workload, resolve_model


@dataclass(frozen=True)
class Variant:
    """None: the build's default on this host (on AMD AVX-512 hosts every step is
    feature-major and every GEMM native)."""

    feature_major_max_tokens: int | None = None
    gemm_fm_max_tokens: int | None = None
    native_prefill: bool = True
    native_transpose: bool = True  # the layout copies; False: torch's
    prefill_flags: tuple[str, ...] = ()  # extra compiler flags of the prefill kernel
    packed_weights: bool = True  # the W16 layout where the build packs; False: row-major
    gemm_flags: tuple[str, ...] = ()  # extra compiler flags of the native GEMM


VARIANTS = {
    "feature_major": Variant(),
    "feature_major_mkl": Variant(FEATURE_MAJOR_MAX_TOKENS, 0, packed_weights=False),
    "sdpa_prefill": Variant(native_prefill=False),
    "torch_transpose": Variant(native_transpose=False),
    "avx2_prefill": Variant(prefill_flags=("-mno-avx512f",)),
    "row_major_weights": Variant(packed_weights=False),
    "row_grains": Variant(gemm_flags=("-DGRAINS_2D=0",)),
    "padded_panels": Variant(gemm_flags=("-DTAIL_PANELS=0",)),
    "token_major": Variant(0, 0, packed_weights=False),
}


def _engine(model_dir: str, items: list[WorkItem], variant: Variant, args) -> LLMEngine:
    config = EngineConfig(
        model=model_dir,
        cache=CacheConfig(
            block_size=16,
            kv_cache_bytes=int(args.kv_cache_gb * 2**30),
            # Both engines must compute every prompt: no hits from an earlier run.
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024
        ),
    )
    engine = LLMEngine(config)
    model = engine.runner.model
    if variant.feature_major_max_tokens is not None:
        model.feature_major_max_tokens = variant.feature_major_max_tokens
    if variant.gemm_fm_max_tokens is not None:
        model.ops.gemm_fm_max_tokens = variant.gemm_fm_max_tokens
    if not variant.native_prefill:
        engine.runner.backend = TorchAttentionBackend(native_prefill=False)
    if variant.gemm_flags:
        model.ops._gemm = load_gemm(variant.gemm_flags)
    if not variant.packed_weights:
        model.unpack_weights()
    if not variant.native_transpose:
        model.ops._transpose = None
    if variant.prefill_flags:
        engine.runner.backend._native_prefill = load_native_prefill(variant.prefill_flags)
    for it in items:
        params = SamplingParams(temperature=0.0, max_tokens=it.max_tokens, ignore_eos=True)
        engine.add_request(it.request_id, it.prompt_token_ids, params)
    return engine


def _prefilling(engine: LLMEngine) -> bool:
    s = engine.scheduler
    return bool(s.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="tiny, small, or a checkpoint dir")
    parser.add_argument("--num-requests", type=int, default=None, help="first N requests only")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gb", type=float, default=2.0, help="per engine")
    parser.add_argument("--pair", default="feature_major,token_major", help="NEW,BASE")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    pair = args.pair.split(",")
    if len(pair) != 2 or len(set(pair)) != 2 or not set(pair) <= set(VARIANTS):
        parser.error(f"--pair: two different variants of {sorted(VARIANTS)}")
    model_dir = resolve_model(args.model)
    spec = read_spec(model_dir)
    items = load_workload("mixed-200", spec.vocab_size, seed=0, limit=args.num_requests)
    engines = {name: _engine(model_dir, items, VARIANTS[name], args) for name in pair}
    seconds = {name: {"prefill_phase_s": 0.0, "decode_phase_s": 0.0} for name in engines}
    tokens: dict[str, dict[str, list[int]]] = {name: {} for name in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            phase = "prefill_phase_s" if _prefilling(engine) else "decode_phase_s"
            start = time.perf_counter()
            for out in engine.step():
                tokens[name].setdefault(out.request_id, []).extend(out.new_token_ids)
            seconds[name][phase] += time.perf_counter() - start
    result: dict = {
        "model": args.model,
        "num_requests": len(items),
        "host": host_info(),
        "pair": pair,
    }
    for name, s in seconds.items():
        total = s["prefill_phase_s"] + s["decode_phase_s"]
        produced = sum(len(t) for t in tokens[name].values())
        result[name] = {**s, "total_s": total, "tok_s": produced / total}
    new, base = result[pair[0]], result[pair[1]]
    result["decode_phase_speedup"] = base["decode_phase_s"] / new["decode_phase_s"]
    result["total_speedup"] = base["total_s"] / new["total_s"]
    a, b = tokens[pair[0]], tokens[pair[1]]
    result["identical_requests"] = sum(a[rid] == b[rid] for rid in a)
    if args.json:
        print(json.dumps(result))
    else:
        for name in pair:
            r = result[name]
            print(
                f"{name:18s} prefill-phase {r['prefill_phase_s']:7.1f} s  decode-phase "
                f"{r['decode_phase_s']:7.1f} s  total {r['total_s']:7.1f} s  "
                f"{r['tok_s']:7.1f} tok/s"
            )
        print(
            f"{pair[0]} over {pair[1]}: decode phase {result['decode_phase_speedup']:.3f}x, "
            f"total {result['total_speedup']:.3f}x; identical requests "
            f"{result['identical_requests']} of {len(items)}"
        )
    return result


if __name__ == "__main__":
    main()
