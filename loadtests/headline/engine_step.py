"""The headline's in-process engine steps, one engine each (loaded once, measured on several
ways):

- bf16: the device's peaks (bf16 GEMM, copy bandwidth); steady decode at each batch size
  against its HBM roofline; prefill throughput against the GEMM peak; a fixed workload's
  output tokens/s and the device's idle share;
- fp8_weights, fp8_kv: steady decode with online FP8 weights, with an FP8 KV cache;
- spec: ngram speculative decoding at batch 1 on prompts that quote the model.

Each also reports the GPU self-check's verdict on the kernels it uses, part by part.

    python -m loadtests.headline.engine_step --variant bf16 --model DIR --device cuda \\
        --dtype bfloat16 --out bf16.json [--quick]
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import torch

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.loader import read_spec
from loadtests import bench_spec
from loadtests.bench_decode import steady_decode
from loadtests.cpu_accounting import host_info
from loadtests.headline.findings import Findings
from loadtests.headline.plan import FULL, QUICK, Sizes, step_parser
from loadtests.headline.roofline import copy_bandwidth, decode_bytes, published_bandwidth
from loadtests.peaks import peak_gemm_flops
from loadtests.roofline import workload_flops
from loadtests.workload import WorkItem

VARIANTS = ("bf16", "fp8_weights", "fp8_kv", "spec")
_CPU_KV_BYTES = 256 << 20  # on the CPU nothing is profiled: a cache the quick sizes fit


def build_engine(args, sizes: Sizes) -> LLMEngine:
    """The variant's engine, sized for what it runs: bf16 every part (its batch the
    workload's), the FP8 ones decode only, spec batch 1."""
    decode_len = sizes.decode_prompt_len + sizes.decode_warmup_steps + sizes.decode_steps
    decode_len += max(sizes.decode_batches) + 1  # steady_decode's slack for early prefills
    max_len = max(
        decode_len,
        sizes.prefill_len + 1,
        sizes.workload_prompt_len[1] + sizes.workload_output_len[1],
        2 * sizes.spec_prompt_len + 2 * sizes.spec_max_tokens,  # X + C + X, then C again
    )
    max_seqs = {"bf16": max(max(sizes.decode_batches), sizes.workload_requests), "spec": 8}
    cache = CacheConfig(
        block_size=16,
        kv_cache_bytes=_CPU_KV_BYTES if args.device == "cpu" else None,
        kv_cache_dtype="fp8_e4m3" if args.variant == "fp8_kv" else "auto",
    )
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization="fp8" if args.variant == "fp8_weights" else None,
        cache=cache,
        scheduler=SchedulerConfig(
            max_num_seqs=max_seqs.get(args.variant, max(sizes.decode_batches)),
            max_num_batched_tokens=sizes.max_num_batched_tokens,
            max_model_len=max_len,
        ),
        speculative=SpeculativeConfig(enabled=args.variant == "spec"),
    )
    return LLMEngine(config)


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_decode(
    engine: LLMEngine, sizes: Sizes, vocab: int, bandwidths: dict[str, float], found: Findings
) -> None:
    """Steady decode at each batch size: the step's time and its HBM roofline (the weights
    and every row's context read once) at the published and the measured bandwidth."""
    context = sizes.decode_prompt_len + sizes.decode_warmup_steps + sizes.decode_steps / 2 + 1
    for batch in sizes.decode_batches:
        with found.part(f"decode_b{batch}"):
            prompts = _random_prompts(batch, sizes.decode_prompt_len, vocab, seed=batch)
            run = steady_decode(
                engine, prompts, sizes.decode_warmup_steps, sizes.decode_steps, tag=f"b{batch}-"
            )
            step_ms = run["step_ms"]
            need = decode_bytes(engine, batch, context)
            published = need / bandwidths["published"] * 1e3
            measured = need / bandwidths["measured"] * 1e3
            found.record(
                **{
                    f"decode_ms_b{batch}": step_ms,
                    f"roofline_ms_b{batch}": published,
                    f"roofline_frac_b{batch}": published / step_ms,
                    f"roofline_frac_measured_bw_b{batch}": measured / step_ms,
                    f"decode_device_idle_frac_b{batch}": run["device_idle_frac"],
                }
            )


def measure_prefill(
    engine: LLMEngine, sizes: Sizes, vocab: int, peak: float, found: Findings
) -> None:
    """`prefill_prompts` prompts of `prefill_len` tokens at once, one output token each."""
    prompts = _random_prompts(sizes.prefill_prompts, sizes.prefill_len, vocab, seed=7)
    items = [WorkItem(f"prefill-{i}", p, 1) for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    _sync(engine.config.device)
    start = time.perf_counter()
    for it in items:
        engine.add_request(it.request_id, it.prompt_token_ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    _sync(engine.config.device)
    wall = time.perf_counter() - start
    flops = workload_flops(read_spec(engine.config.model), items)
    found.record(
        prefill_tok_s=sizes.prefill_prompts * sizes.prefill_len / wall,
        prefill_flops_frac=flops / wall / peak,
    )


def measure_workload(engine: LLMEngine, sizes: Sizes, vocab: int, found: Findings) -> None:
    """`workload_requests` requests of random lengths, all at once: output tokens/s and the
    share of the time the device had no step to run (the host's cost per step)."""
    rng = random.Random(11)
    params = []
    for i in range(sizes.workload_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*sizes.workload_prompt_len))]
        params.append((f"work-{i}", prompt, rng.randint(*sizes.workload_output_len)))
    clock = engine.runner.device_clock
    _sync(engine.config.device)
    busy_before, start = clock.seconds, time.perf_counter()
    for rid, prompt, max_tokens in params:
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(rid, prompt, sampling)
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    wall = time.perf_counter() - start
    expected = sum(max_tokens for _, _, max_tokens in params)
    if produced != expected:
        raise RuntimeError(f"the workload produced {produced} tokens, expected {expected}")
    found.record(
        engine_tok_s=produced / wall,
        engine_device_idle_frac=max(0.0, 1.0 - (clock.seconds - busy_before) / wall),
    )


def measure_ngram(engine: LLMEngine, sizes: Sizes, vocab: int, found: Findings) -> None:
    """Batch 1, speculation off then on (ngram), on a prompt that quotes the model."""
    args = SimpleNamespace(prompt_len=sizes.spec_prompt_len, max_tokens=sizes.spec_max_tokens)
    bench_spec.decode_phase(engine, _random_prompts(1, 16, vocab, 0), 8, "warm-up")
    row = bench_spec.run_ngram((engine, engine), 1, args, vocab)
    found.record(
        ngram_speedup_b1=row["speedup"],
        ngram_acceptance=row["acceptance"] or 0.0,  # None: nothing was drafted
        ngram_draft_tokens=row["draft_tokens"],
        ngram_tok_s_off=row["tokens_per_s_off"],
        ngram_tok_s_on=row["tokens_per_s_on"],
    )


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    host = host_info()
    return f"{host['cpu']} ({host['cpus']} cores)"


def main(argv: list[str] | None = None) -> None:
    parser = step_parser(__doc__)
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    found = Findings(args.out)
    device = args.device
    bandwidths: dict[str, float] = {}
    if args.variant != "spec":
        with found.part("peaks"):
            measured = copy_bandwidth(device, (1 << 30) if device == "cuda" else (128 << 20))
            published, row = published_bandwidth(device)
            # Without a datasheet row (the CPU), the measured bandwidth stands in for it.
            bandwidths = {"measured": measured, "published": published or measured}
            found.record(
                copy_bw_gb_s=measured / 1e9,
                published_bw_gb_s=bandwidths["published"] / 1e9,
                published_bw_source=row or "measured copy (no datasheet row)",
            )
    if args.variant == "bf16":
        found.record(
            device_name=device_name(device), torch=torch.__version__, cuda=torch.version.cuda
        )
        with found.part("gemm_peak"):
            n = 8192 if device == "cuda" else 512
            peak = peak_gemm_flops(n=n, device=device, dtype=args.dtype)
            found.record(gemm_peak_tflop_s=peak / 1e12)
    start = time.perf_counter()
    engine = build_engine(args, sizes)
    found.record(load_s=time.perf_counter() - start)
    vocab = min(engine.runner_vocab_size(), read_spec(args.model).vocab_size)
    if engine.runner.self_check:  # the parts this variant's kernels use (on CUDA)
        found.record(
            self_check={c.part: c.result for c in engine.runner.self_check},
            self_check_reasons={c.part: c.reason for c in engine.runner.self_check if c.reason},
        )
    if args.variant == "spec":
        with found.part("ngram"):
            measure_ngram(engine, sizes, vocab, found)
    elif bandwidths:
        measure_decode(engine, sizes, vocab, bandwidths, found)
    if args.variant == "bf16":
        if "gemm_peak_tflop_s" in found.figures:
            with found.part("prefill"):
                peak = found.figures["gemm_peak_tflop_s"] * 1e12
                measure_prefill(engine, sizes, vocab, peak, found)
        with found.part("workload"):
            measure_workload(engine, sizes, vocab, found)
    engine.close()


if __name__ == "__main__":
    main()
