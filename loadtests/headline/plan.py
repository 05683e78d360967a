"""The GPU headline's steps: what each measures, in how long at most, and its sizes.

Each step is its own process (a fresh device, its own timeout); the timeouts add up to
`BUDGET_S`, so the whole stage ends within it however its steps fare.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

BUDGET_S = 540


@dataclass(frozen=True)
class Sizes:
    decode_batches: tuple[int, ...]
    decode_prompt_len: int  # the context a decode step reads is about this
    decode_steps: int  # timed steps per batch size
    decode_warmup_steps: int
    prefill_prompts: int
    prefill_len: int
    workload_requests: int  # all at once
    workload_prompt_len: tuple[int, int]  # uniform, inclusive
    workload_output_len: tuple[int, int]
    max_num_batched_tokens: int
    spec_prompt_len: int  # the ngram prompts are X, the model's continuation of X, X again
    spec_max_tokens: int
    http_prompts: int
    http_concurrency: int
    http_input_len: int
    http_output_len: int
    chat_prompts: int  # one at a time: the latency one chat user feels
    chat_input_len: int
    chat_output_len: int

    def decode_keys(self) -> list[str]:
        names = ("decode_ms", "roofline_ms", "roofline_frac", "roofline_frac_measured_bw")
        return [f"{name}_b{b}" for b in self.decode_batches for name in names]

    def speedup_keys(self) -> list[str]:
        """An FP8 variant's decode step against bf16's, batch by batch."""
        return [f"vs_bf16_b{b}" for b in self.decode_batches]


FULL = Sizes(
    decode_batches=(1, 32, 128),
    decode_prompt_len=1024,
    decode_steps=32,
    decode_warmup_steps=4,
    prefill_prompts=8,
    prefill_len=2048,
    workload_requests=256,
    workload_prompt_len=(128, 1024),
    workload_output_len=(128, 256),
    max_num_batched_tokens=8192,
    spec_prompt_len=128,
    spec_max_tokens=128,
    http_prompts=256,
    http_concurrency=64,
    http_input_len=256,
    http_output_len=128,
    chat_prompts=8,
    chat_input_len=128,
    chat_output_len=64,
)
# The same stage on the tiny model on a CPU, in about a minute: it keeps the script honest
# between GPU runs (tests/loadtests/test_headline.py).
QUICK = Sizes(
    decode_batches=(1, 4, 8),
    decode_prompt_len=32,
    decode_steps=4,
    decode_warmup_steps=1,
    prefill_prompts=2,
    prefill_len=64,
    workload_requests=8,
    workload_prompt_len=(8, 32),
    workload_output_len=(4, 8),
    max_num_batched_tokens=256,
    spec_prompt_len=16,
    spec_max_tokens=12,
    http_prompts=8,
    http_concurrency=4,
    http_input_len=32,
    http_output_len=8,
    chat_prompts=2,
    chat_input_len=16,
    chat_output_len=6,
)


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: int
    module: str  # run as `python -m module --variant name ...`
    keys: tuple[str, ...]  # the numeric figures it reports (null where it did not finish)


def steps(sizes: Sizes) -> list[Step]:
    engine = "loadtests.headline.engine_step"
    return [
        Step("checkpoint", 75, "loadtests.headline.checkpoint_step", ("write_s",)),
        Step(
            "bf16",
            135,
            engine,
            (
                "gemm_peak_tflop_s",
                "copy_bw_gb_s",
                "published_bw_gb_s",
                "load_s",
                *sizes.decode_keys(),
                "prefill_tok_s",
                "prefill_flops_frac",
                "engine_tok_s",
                "engine_device_idle_frac",
            ),
        ),
        Step("fp8_weights", 60, engine, ("load_s", *sizes.decode_keys(), *sizes.speedup_keys())),
        Step("fp8_kv", 55, engine, ("load_s", *sizes.decode_keys(), *sizes.speedup_keys())),
        Step(
            "spec",
            55,
            engine,
            ("load_s", "ngram_speedup_b1", "ngram_acceptance", "ngram_tok_s_off", "ngram_tok_s_on"),
        ),
        Step(
            "http",
            160,
            "loadtests.headline.http_step",
            (
                "app_start_s",
                "http_output_tok_s",
                "engine_output_tok_s",
                "http_vs_engine",
                "http_ttft_ms_median",
                "http_failed",
                "chat_http_ttft_ms_median",
                "chat_http_itl_ms_median",
                "chat_engine_ttft_ms_median",
                "chat_engine_itl_ms_median",
            ),
        ),
    ]


def step_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every step takes (the orchestrator's command line for it)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", required=True, help="the checkpoint dir (or where it goes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", required=True, help="the step's JSON file")
    parser.add_argument("--quick", action="store_true", help="the CPU test's sizes")
    return parser
