"""The headline's serving step: deploy.yaml's app with its GPU lines on a local Ray, streamed
chat over HTTP (`http_concurrency` at a time, then one at a time), then the in-process
engine, configured as the replica was, on the same prompts at the same concurrencies.

    python -m loadtests.headline.http_step --model DIR --device cuda --dtype bfloat16 \\
        --out http.json [--quick]
"""

from __future__ import annotations

import asyncio
import glob
import statistics
import time

import torch

from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from loadtests.headline.findings import Findings
from loadtests.headline.plan import FULL, QUICK, Sizes, step_parser
from loadtests.serve_bench import build_parser, deploy_args, load_requests, run, summarize

APP = "headline"


def app_overrides(args) -> dict:
    """deploy.yaml's lines marked GPU, for this device; one engine replica, no autoscaling."""
    gpu = args.device == "cuda"
    return {
        "model": args.model,
        "served_model_name": APP,
        "engine.dtype": args.dtype,
        "engine.device": args.device,
        "engine.kv_cache_bytes": None if gpu else 256 << 20,
        "engine_replicas.num_gpus": 1 if gpu else 0,
        "autoscaling": None,
        "request_timeout_s": 120,
    }


def bench_options(count: int, input_len: int, output_len: int, concurrency: int):
    return build_parser().parse_args(
        [
            *("--endpoint", "chat", "--num-prompts", str(count)),
            *("--random-input-len", str(input_len), "--random-output-len", str(output_len)),
            *("--max-concurrency", str(concurrency), "--request-timeout", "120"),
        ]
    )


def over_http(url: str, sizes: Sizes, found: Findings) -> dict[str, list[str]]:
    """Both loads against the app; returns each load's prompts (chat text)."""
    loads = {
        "http": bench_options(
            sizes.http_prompts, sizes.http_input_len, sizes.http_output_len, sizes.http_concurrency
        ),
        "chat": bench_options(sizes.chat_prompts, sizes.chat_input_len, sizes.chat_output_len, 1),
    }
    prompts = {}
    for name, opts in loads.items():
        requests = load_requests(opts, url, APP)
        outcomes, duration = asyncio.run(run(opts, url, APP, requests))
        result = summarize(outcomes, duration, {}, opts.max_concurrency)
        if result["failed"]:
            print(
                f"{name}: {result['failed']} failed, first:", next(e for e in result["errors"] if e)
            )
        if name == "http":
            found.record(
                http_output_tok_s=result["output_throughput"],
                http_ttft_ms_median=result["median_ttft_ms"],
                http_failed=result["failed"],
            )
        else:
            found.record(
                chat_http_ttft_ms_median=result["median_ttft_ms"],
                chat_http_itl_ms_median=result["median_itl_ms"],
            )
        prompts[name] = [r.prompt for r in requests]
    return prompts


def closed_loop(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> dict[str, float]:
    """The prompts through the engine, at most `concurrency` at a time (the next one added as
    one ends, as the HTTP clients do): output tokens/s, median TTFT and gap between a
    request's steps that brought it tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    waiting = list(enumerate(prompts))
    added: dict[str, float] = {}
    last: dict[str, float] = {}
    ttfts: list[float] = []
    gaps: list[float] = []
    running = produced = 0
    start = time.perf_counter()

    def admit() -> None:
        nonlocal running
        while waiting and running < concurrency:
            i, prompt = waiting.pop(0)
            engine.add_request(f"c{concurrency}-{i}", prompt, params)
            added[f"c{concurrency}-{i}"] = time.perf_counter()
            running += 1

    admit()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                produced += len(out.new_token_ids)
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                else:
                    ttfts.append(now - added[out.request_id])
                last[out.request_id] = now
            if out.finished:
                running -= 1
        admit()
    return {
        "tok_s": produced / (time.perf_counter() - start),
        "ttft_ms": 1e3 * statistics.median(ttfts),
        "itl_ms": 1e3 * statistics.median(gaps or [0.0]),
    }


def in_process(app_args, sizes: Sizes, prompts: dict[str, list[str]], found: Findings) -> None:
    """The replica's engine config in this process, on the same chat prompts."""
    engine = LLMEngine(app_args.engine.engine_config(app_args.model))
    tokenizer = engine.tokenizer

    def chat_ids(text: str) -> list[int]:
        turns = [{"role": "user", "content": text}]
        templated = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(templated, add_special_tokens=False)

    http = [chat_ids(p) for p in prompts["http"]]
    closed_loop(engine, http[:1], sizes.http_output_len, 1)  # warm-up, as the HTTP bench's
    loaded = closed_loop(engine, http, sizes.http_output_len, sizes.http_concurrency)
    found.record(
        engine_output_tok_s=loaded["tok_s"],
        http_vs_engine=found.figures["http_output_tok_s"] / loaded["tok_s"],
    )
    chat = closed_loop(engine, [chat_ids(p) for p in prompts["chat"]], sizes.chat_output_len, 1)
    found.record(
        chat_engine_ttft_ms_median=chat["ttft_ms"], chat_engine_itl_ms_median=chat["itl_ms"]
    )
    engine.close()


def _wait_for_free_gpu(timeout_s: float = 30.0) -> None:
    """Until the stopped replica's process has given its GPU memory back."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free > 0.9 * total:
            return
        time.sleep(0.5)


def _print_serve_logs() -> None:
    """The replicas' logs (Ray keeps them from the driver here), for a failed step's log."""
    for path in sorted(glob.glob("/tmp/ray/session_latest/logs/serve/*.log")):
        with open(path, errors="replace") as f:
            tail = f.readlines()[-30:]
        print(f"--- {path}\n{''.join(tail)}")


def main(argv: list[str] | None = None) -> None:
    parser = step_parser(__doc__)
    parser.add_argument("--config", default="deploy.yaml")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    found = Findings(args.out)
    app_args = deploy_args(args.config, app_overrides(args))

    from serve_app import build_app
    from serve_app.deploy.local_cluster import (
        ingress_url,
        run_app,
        start_local_serve,
        stop_local_serve,
    )

    prompts = None
    start = time.perf_counter()
    gpus = torch.cuda.device_count() if args.device == "cuda" else None
    port = start_local_serve(log_level="WARNING", num_gpus=gpus)
    try:
        with found.part("app"):
            run_app(build_app(app_args), APP)
            found.record(app_start_s=time.perf_counter() - start)
            with found.part("over_http"):
                prompts = over_http(ingress_url(APP, port), sizes, found)
        if found.errors or found.figures.get("http_failed"):
            _print_serve_logs()
    finally:
        stop_local_serve()
    if prompts is not None:
        with found.part("in_process"):
            if args.device == "cuda":
                _wait_for_free_gpu()
            in_process(app_args, sizes, prompts, found)


if __name__ == "__main__":
    main()
