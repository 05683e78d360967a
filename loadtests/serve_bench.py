"""A serving benchmark of any OpenAI-compatible server, reported as vLLM's `bench serve`.

    python -m loadtests.serve_bench --url http://127.0.0.1:8000 --endpoint chat \\
        --dataset random --random-input-len 256 --random-output-len 128 \\
        --num-prompts 200 --max-concurrency 64
    python -m loadtests.serve_bench --start-app deploy.yaml --dataset sharegpt \\
        --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --goodput ttft:1000 tpot:100

Sends `--num-prompts` streamed requests (greedy, `ignore_eos`, so each makes exactly its
max_tokens) at most `--max-concurrency` at a time, arriving all at once or as a Poisson
process of `--request-rate` per second, after one warm-up request. Prints what vLLM's
benchmark prints (requests, duration, input and output tokens, request / output / total
token throughput, goodput under the SLOs of `--goodput`; TTFT, TPOT, ITL and E2E latency mean,
median and p99) and writes it, per-request figures included, to `--result-file` as JSON.
Random prompts are token ids (sent as text through the server's /detokenize for chat);
ShareGPT prompts are counted with the server's /tokenize. `--start-app` runs deploy.yaml's
app on a local Ray first (Serve's direct ingress), with `--override KEY=VALUE` changes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtests.bench_dataset import BenchRequest, random_requests, sharegpt_requests
from loadtests.sweep.cli import apply_overrides, parse_override


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # between content chunks, as vLLM's
    prompt_tokens: int = 0
    output_tokens: int = 0


async def send(client, model: str, endpoint: str, req: BenchRequest) -> Outcome:
    """One streamed request, timed chunk by chunk; failures are counted, never raised."""
    out = Outcome(prompt_tokens=req.prompt_len)
    kwargs: dict[str, Any] = dict(model=model, max_tokens=req.output_len, temperature=0.0)
    kwargs |= dict(stream=True, stream_options={"include_usage": True})
    kwargs["extra_body"] = {"ignore_eos": True}
    started = time.perf_counter()
    last = None
    chunks = 0
    try:
        if endpoint == "chat":
            messages = [{"role": "user", "content": req.prompt}]
            stream = await client.chat.completions.create(messages=messages, **kwargs)
        else:
            stream = await client.completions.create(prompt=req.prompt, **kwargs)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                out.prompt_tokens = chunk.usage.prompt_tokens
                out.output_tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text = choice.delta.content if endpoint == "chat" else choice.text
            if not text:
                continue
            chunks += 1
            if last is None:
                out.ttft_s = now - started
            else:
                out.itl_s.append(now - last)
            last = now
        out.e2el_s = time.perf_counter() - started
        out.output_tokens = out.output_tokens or chunks  # a server that sends no usage
        out.ok = last is not None
        out.error = "" if out.ok else "no content"
    except Exception as exc:  # HTTP errors, resets, timeouts: counted
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out


async def run(opts: argparse.Namespace, url: str, model: str, requests: list[BenchRequest]):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=opts.api_key, max_retries=0)
    client = client.with_options(timeout=opts.request_timeout)
    warm = await send(client, model, opts.endpoint, requests[0])
    if not warm.ok:
        raise SystemExit(f"the warm-up request failed: {warm.error}")
    gate = asyncio.Semaphore(opts.max_concurrency or len(requests))
    rng = random.Random(opts.seed)

    async def limited(req: BenchRequest) -> Outcome:
        async with gate:
            return await send(client, model, opts.endpoint, req)

    started = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(limited(req)))
        if opts.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(opts.request_rate))
    outcomes = await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    await client.close()
    return outcomes, duration


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.array(values_s or [0.0]) * 1e3
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def summarize(
    outcomes: list[Outcome], duration: float, slos_ms: dict[str, float], max_concurrency: int
) -> dict[str, Any]:
    done = [o for o in outcomes if o.ok]
    tpot = {id(o): (o.e2el_s - o.ttft_s) / (o.output_tokens - 1) for o in done}
    tpot = {k: v for k, v in tpot.items() if np.isfinite(v) and v >= 0}
    inputs = sum(o.prompt_tokens for o in done)
    outputs = sum(o.output_tokens for o in done)

    def good(o: Outcome) -> bool:
        measured = {"ttft": o.ttft_s, "tpot": tpot.get(id(o), 0.0), "e2el": o.e2el_s}
        return all(measured[k] * 1e3 <= slo for k, slo in slos_ms.items())

    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "max_concurrency": max_concurrency,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(done) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
    }
    if slos_ms:
        result["request_goodput"] = sum(map(good, done)) / duration
    result |= _stats("ttft", [o.ttft_s for o in done])
    result |= _stats("tpot", list(tpot.values()))
    result |= _stats("itl", [g for o in done for g in o.itl_s])
    result |= _stats("e2el", [o.e2el_s for o in done])
    result["input_lens"] = [o.prompt_tokens for o in outcomes]
    result["output_lens"] = [o.output_tokens for o in outcomes]
    result["ttfts"] = [o.ttft_s for o in outcomes]
    result["itls"] = [o.itl_s for o in outcomes]
    result["e2els"] = [o.e2el_s for o in outcomes]
    result["errors"] = [o.error for o in outcomes]
    return result


def report(result: dict[str, Any]) -> str:
    """The result in vLLM's layout."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if "request_goodput" in result:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for key, title in [
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ]:
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat, name in [("mean", "Mean"), ("median", "Median"), ("p99", "P99")]:
            row(f"{name} {key.upper()} (ms):", result[f"{stat}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def load_requests(opts: argparse.Namespace, url: str, model: str) -> list[BenchRequest]:
    def server(route: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {opts.api_key}"}
        resp = httpx.post(f"{url}{route}", json={"model": model} | body, headers=headers)
        resp.raise_for_status()
        return resp.json()

    if opts.dataset == "sharegpt":
        if opts.dataset_path is None:
            raise SystemExit("--dataset sharegpt needs --dataset-path")

        def tokenize(text: str) -> list[int]:
            return server("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

        return sharegpt_requests(
            Path(opts.dataset_path), opts.num_prompts, tokenize, opts.seed, opts.sharegpt_output_len
        )
    lo, hi = (int(x) for x in opts.token_range.split(","))
    requests = random_requests(
        opts.num_prompts, opts.random_input_len, opts.random_output_len, (lo, hi), opts.seed
    )
    if opts.endpoint == "chat":  # chat takes text: the ids' text, counted again by the server
        requests = [
            BenchRequest(
                server("/detokenize", {"tokens": r.prompt})["prompt"], r.prompt_len, r.output_len
            )
            for r in requests
        ]
    return requests


def parse_slos(items: list[str]) -> dict[str, float]:
    """vLLM's `--goodput KEY:MS ...` (ttft, tpot, e2el)."""
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, not {item!r}")
        slos[key] = float(value)
    return slos


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--start-app", default=None, help="deploy.yaml: start it locally first")
    parser.add_argument("--override", action="append", default=[], type=parse_override)
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON")
    parser.add_argument("--sharegpt-output-len", type=int, default=None)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--token-range", default="32,1000", help="random prompt ids: lo,hi")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--goodput", nargs="+", default=[], help="ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", default=None, help="write the result here as JSON")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    opts = parser.parse_args(argv)
    slos = parse_slos(opts.goodput)
    if opts.start_app is None:
        return _bench(opts, opts.url.rstrip("/"), slos)

    from serve_app import build_app
    from serve_app.deploy.local_cluster import (
        ingress_url,
        run_app,
        start_local_serve,
        stop_local_serve,
    )

    args = deploy_args(opts.start_app, {k: v for o in opts.override for k, v in o.items()})
    port = start_local_serve(log_level="WARNING")
    try:
        run_app(build_app(args), "bench")
        return _bench(opts, ingress_url("bench", port), slos)
    finally:
        stop_local_serve()


def deploy_args(path: str, overrides: dict[str, Any]):
    """The first application's validated AppArgs of a deploy.yaml, with dotted overrides."""
    import yaml

    from serve_app.config import AppArgs

    with open(path) as f:
        app_args = yaml.safe_load(f)["applications"][0]["args"]
    return AppArgs.model_validate(apply_overrides(app_args, overrides))


def _bench(opts: argparse.Namespace, url: str, slos: dict[str, float]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {opts.api_key}"}
    model = opts.model or httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    requests = load_requests(opts, url, model)
    outcomes, duration = asyncio.run(run(opts, url, model, requests))
    result = summarize(outcomes, duration, slos, opts.max_concurrency or len(requests))
    result |= {"url": url, "model": model, "endpoint": opts.endpoint, "dataset": opts.dataset}
    result |= {"num_prompts": opts.num_prompts, "request_rate": opts.request_rate}
    print(report(result))
    if opts.result_file:
        Path(opts.result_file).write_text(json.dumps(result))
    if result["failed"]:
        print("first failure:", next(e for e in result["errors"] if e))
    return result


if __name__ == "__main__":
    main()
