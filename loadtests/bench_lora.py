"""Many LoRA adapters in one batch against the base model alone, on the real engine.

    python -m loadtests.bench_lora [--model small] [--concurrency 64] [--rank 16]
        [--adapters 1,4,16] [--prompt-len 64] [--max-tokens 64] [--repeat 3]
        [--targets q_proj,...] [--device cpu] [--dtype float32] [--json]

`--concurrency` requests run together (added at once, prompt and decode), each with an
adapter drawn uniformly or by Zipf's law (s = 1) over N random adapters of rank `--rank` on
`--targets` (default every linear layer: q, k, v, o, gate, up, down), one device slot each;
the baseline is the same requests without adapters on the same engine, measured in the same
run, runs interleaved (`--repeat` rounds; figures are medians). With --json the output ends with one
JSON object holding `ratio_16_adapters` (16 adapters, uniform: tokens/s over the base's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.lora_config import LoRAConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.lora.random_adapter import write_random_adapter
from loadtests.workload import resolve_model

ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapters_of(
    model: str, count: int, rank: int, targets: tuple[str, ...] = ALL_LINEARS
) -> dict[str, str]:
    """`count` random adapters of `model` (written once, under models/)."""
    kind = "all" if targets == ALL_LINEARS else "-".join(t.removesuffix("_proj") for t in targets)
    root = Path(model).parent / f"{Path(model).name}-lora-r{rank}-{kind}"
    paths = {}
    for i in range(count):
        out = root / f"a{i}"
        if not (out / "adapter_config.json").is_file():
            write_random_adapter(model, out, rank, targets, seed=i, std=0.02)
        paths[f"a{i}"] = str(out)
    return paths


def choices(names: list[str], n: int, law: str, seed: int) -> list[str | None]:
    if not names:
        return [None] * n
    weights = [1.0 / (i + 1) for i in range(len(names))] if law == "zipf" else None
    return random.Random(seed).choices(names, weights=weights, k=n)


def run(engine: LLMEngine, prompts: list[list[int]], loras: list, max_tokens: int) -> float:
    """Output tokens/s of the prompts run together to completion."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(prompts, params, loras)
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", default="1,4,16")
    parser.add_argument(
        "--targets", default=",".join(ALL_LINEARS), help="the linear layers adapters adapt"
    )
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = resolve_model(args.model)
    counts = [int(c) for c in args.adapters.split(",")]
    adapters = adapters_of(model, max(counts), args.rank, tuple(args.targets.split(",")))
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            cache=CacheConfig(block_size=16),
            scheduler=SchedulerConfig(
                max_num_seqs=args.concurrency,
                max_model_len=args.prompt_len + args.max_tokens + 16,
            ),
            lora=LoRAConfig(
                enabled=True, adapters=adapters, max_loras=max(counts), max_lora_rank=args.rank
            ),
        )
    )
    rng = random.Random(0)
    vocab = engine.runner_vocab_size()
    prompts = [
        [rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.concurrency)
    ]
    names = list(adapters)
    cases = {"base": [None] * args.concurrency}
    for count in counts:
        for law in ("uniform", "zipf") if count > 1 else ("uniform",):
            cases[f"{count} {law}"] = choices(names[:count], args.concurrency, law, count)
    run(engine, prompts, cases[f"{max(counts)} uniform"], 4)  # warm-up: adapters in slots
    rates: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.repeat):
        for case, loras in cases.items():  # interleaved: host drift hits every case alike
            rates[case].append(run(engine, prompts, loras, args.max_tokens))
    base = statistics.median(rates["base"])
    print(f"{args.model}, {args.concurrency} requests, rank {args.rank}, medians of {args.repeat}")
    print(f"{'case':<14}{'tokens/s':>10}{'x base':>9}")
    summary = {}
    for case, values in rates.items():
        rate = statistics.median(values)
        summary[case] = {"tokens_per_s": round(rate, 1), "ratio": round(rate / base, 3)}
        print(f"{case:<14}{rate:>10.1f}{rate / base:>9.2f}")
    if args.json:
        key = f"{max(counts)} uniform"
        out = {"ratio_16_adapters": summary.get("16 uniform", summary[key])["ratio"]}
        print(json.dumps({**out, "cases": summary, "args": vars(args)}))


if __name__ == "__main__":
    main()
