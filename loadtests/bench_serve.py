"""Serving overhead: the standard workload through HTTP (Ray Serve) vs in process, one run.

    python -m loadtests.bench_serve [--model small] [--concurrency 32] [--json]
    python -m loadtests.bench_serve --concurrency 1 --chat --trace ...   (TTFT stage by stage)
    python -m loadtests.bench_serve sweep --url http://127.0.0.1:8000 ...   (loadtests/sweep/cli.py)

Both sides run the same engine settings and the same closed loop: `concurrency` clients, each
sending its next request when the previous one ends, streaming. In process the clients call
AsyncLLMEngine directly; over HTTP they are SSE streams to /v1/completions served by the OpenAI
ingress replica (Serve's direct ingress; `--via-proxy` adds Serve's HTTP proxy in front), which
streams from one engine replica through a DeploymentHandle. Prints output tokens/s of each, their
ratio, TTFT and ITL (mean inter-token latency of a request) p50/p99, the share of CPU the
hypervisor stole during each side, and the CPU each process spent per output token over HTTP.
`--chat` sends each prompt's text as a chat message (the in-process side gets the chat template
applied to it); `--trace` has the app write trace spans and splits the HTTP TTFT into stages
(loadtests/ttft_stages.py); `--paired K` (one client) then sends every prompt K times more,
in process and over HTTP back to back, and reads what serving adds to the same prompt
(loadtests/latency_pairs.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtests import cpu_accounting
from loadtests.closed_loop import run_http, run_inprocess
from loadtests.latency_pairs import run_pairs
from loadtests.ttft_stages import ttft_stages
from loadtests.workload import WorkItem, as_chat, load_workload, resolve_model
from serve_app.config import AppArgs
from serve_app.deploy.local_cluster import stop_local_serve


def start_serve(args: AppArgs) -> list[str]:
    """A local Ray instance and the app; returns the /v1 base URLs (each ingress replica's
    own port when Serve's direct ingress is on, else the proxy's)."""

    from serve_app import build_app
    from serve_app.deploy.local_cluster import ingress_urls, run_app, start_local_serve

    port = start_local_serve(log_level="WARNING")
    run_app(build_app(args), "bench")
    return [url + "/v1" for url in ingress_urls("bench", port)]


# --------------------------------------------------------------------------------- main
async def _rounds(
    opts, args: AppArgs, base_v1: list[str], items: list[WorkItem]
) -> tuple[list[tuple], dict[str, Any] | None, list]:
    """Alternate in-process and HTTP rounds so that machine drift hits both alike; then, with
    `--paired`, the pairs' summary and their HTTP timings."""
    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import LLMEngine

    engine = AsyncLLMEngine.built(lambda: LLMEngine(args.engine.engine_config(args.model)))
    rounds = []
    try:
        for r in range(opts.repeat):
            fresh = [replace(it, request_id=f"{it.request_id}#{r}") for it in items]
            inproc_run = await run_inprocess(engine, fresh, opts.concurrency)
            http_run = await run_http(base_v1, args.model_name, items, opts.concurrency)
            inproc, http = inproc_run.summary(), http_run.summary()
            rounds.append((inproc, http, http_run.cpu_ms_per_token(), http_run.timings))
            print(
                f"round {r}: in process {inproc['tok_s']:.1f} tok/s, HTTP {http['tok_s']:.1f}"
                f" tok/s, ratio {http['tok_s'] / inproc['tok_s']:.3f}; steal"
                f" {inproc['steal_frac']:.1%} / {http['steal_frac']:.1%}, adjusted ratio"
                f" {http['tok_s_steal_adjusted'] / inproc['tok_s_steal_adjusted']:.3f}",
                file=sys.stderr,
            )
        if not opts.paired:
            return rounds, None, []
        from loadtests.sse_client import SseClient

        client = SseClient(base_v1[0])
        try:
            pairs = await run_pairs(engine, client, args.model_name, items, opts.paired)
        finally:
            await client.close()
        return rounds, pairs.summary(), [http for _, http in pairs.pairs]
    finally:
        await engine.shutdown()


def _median_summary(summaries: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}


def _median_cpu(per_round: list[dict[str, float]]) -> dict[str, float]:
    names = {n for r in per_round for n in r}
    medians = {n: statistics.median(r.get(n, 0.0) for r in per_round) for n in names}
    return dict(sorted(medians.items(), key=lambda x: -x[1]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sweep":  # latency-throughput curves: loadtests/sweep/cli.py
        from loadtests.sweep import cli as sweep

        return sweep.main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="tiny | small | a checkpoint dir")
    parser.add_argument("--workload", default="mixed-200")
    parser.add_argument("--num-requests", type=int, default=None, help="first N requests only")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="alternating rounds; medians")
    parser.add_argument(
        "--stream-interval", type=float, default=0.0, help="AppArgs.stream_interval_s"
    )
    parser.add_argument(
        "--per-request-streams",
        action="store_true",
        help="AppArgs.delta_channels false: each request streams its deltas on its own call",
    )
    parser.add_argument(
        "--deltas-on-ray",
        action="store_true",
        help="AppArgs.delta_links false: the channels' batches as Ray messages, not on a "
        "TCP connection",
    )
    parser.add_argument(
        "--via-proxy",
        action="store_true",
        help="go through Serve's HTTP proxy instead of straight to the ingress replica",
    )
    parser.add_argument(
        "--serve-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Ray Serve flag for the cluster this run starts (repeatable), "
        "e.g. RAY_SERVE_ENABLE_DIRECT_INGRESS=1",
    )
    parser.add_argument(
        "--emulate",
        default=None,
        metavar="MODEL@GPU",
        help="engine.device emulated, e.g. Llama-3.1-8B@H100-80GB: both sides run the cost "
        "model's step times on the wall clock (docs/emulated-replica.md), the serving path at "
        "a GPU's token rate",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="engine.device (default: the engine's own, cpu): cuda puts the engine replica, "
        "and the in-process engine beside it, on this node's GPU (both at once: --kv-cache-gb "
        "each)",
    )
    parser.add_argument("--dtype", default=None, help="engine.dtype, e.g. bfloat16 on a GPU")
    parser.add_argument("--ingress-replicas", type=int, default=1)
    parser.add_argument(
        "--chat", action="store_true", help="streamed chat completions instead of completions"
    )
    parser.add_argument(
        "--trace", action="store_true", help="trace spans to a file; the HTTP TTFT by stage"
    )
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="K",
        help="one client: after the rounds, every prompt K times more in process and over "
        "HTTP back to back; the median of what serving added to each",
    )
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args(argv)
    if opts.paired and opts.concurrency != 1:
        parser.error("--paired measures one client: --concurrency 1")
    # Serve's direct ingress (the default of serve_app.deploy.local_cluster): the ingress replica
    # serves HTTP on its own port, one Ray hop (and its CPU per streamed token) fewer than
    # through the proxy.
    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "0" if opts.via_proxy else "1"
    for kv in opts.serve_env:
        key, _, value = kv.partition("=")
        os.environ[key] = value

    model_dir = resolve_model(opts.model)
    spans = None
    if opts.trace:
        spans = Path(tempfile.mkdtemp(prefix="bench_serve_")) / "spans.jsonl"
    device: dict[str, Any] = {"device": opts.device} if opts.device else {}
    if opts.emulate:
        name, _, gpu = opts.emulate.partition("@")
        device = {"device": "emulated", "emulate": {"model": name, "gpu": gpu or "H100-80GB"}}
    if opts.dtype:
        device["dtype"] = opts.dtype
    args = AppArgs.model_validate(
        {
            "model": model_dir,
            "served_model_name": "bench",
            "max_queued_requests": opts.concurrency,
            "stream_interval_s": opts.stream_interval,
            "delta_channels": not opts.per_request_streams,
            "delta_links": not opts.deltas_on_ray,
            "engine": {
                "kv_cache_bytes": int(opts.kv_cache_gb * 2**30),
                "max_num_seqs": opts.concurrency,
                "max_num_batched_tokens": opts.max_num_batched_tokens,
                "max_model_len": 1024,
                "num_threads": opts.threads,
                # Rounds repeat the same prompts: a warm prefix cache would flatter every
                # round after the first (the workload itself shares no prefixes).
                "enable_prefix_caching": False,
                **device,
            },
            "engine_replicas": {
                "num_replicas": 1,
                "num_cpus": 0 if opts.emulate else 1,
                "num_gpus": 1 if opts.device == "cuda" else 0,
            },
            "ingress_replicas": {"num_replicas": opts.ingress_replicas, "num_cpus": 0.5},
            "tracing": {"exporter": "file", "file_path": str(spans)} if spans else {},
        }
    )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    items = load_workload(opts.workload, vocab, opts.seed, opts.num_requests)
    if opts.chat:
        items = as_chat(items, model_dir)

    base_v1 = start_serve(args)
    try:
        rounds, paired, paired_http = asyncio.run(_rounds(opts, args, base_v1, items))
    finally:
        stop_local_serve()
    inproc = _median_summary([r[0] for r in rounds])
    http = _median_summary([r[1] for r in rounds])

    result: dict[str, Any] = {
        "model": opts.model,
        "emulate": opts.emulate,
        "device": opts.device,
        "dtype": opts.dtype,
        "ingress_replicas": opts.ingress_replicas,
        "num_requests": len(items),
        "concurrency": opts.concurrency,
        "http_tok_s": http["tok_s"],
        "inprocess_tok_s": inproc["tok_s"],
        # Median of per-round ratios: each round's two sides ran minutes apart, not hours.
        "http_over_inprocess": statistics.median(h["tok_s"] / i["tok_s"] for i, h, *_ in rounds),
        "per_round_ratio": [h["tok_s"] / i["tok_s"] for i, h, *_ in rounds],
        "http_over_inprocess_steal_adjusted": statistics.median(
            h["tok_s_steal_adjusted"] / i["tok_s_steal_adjusted"] for i, h, *_ in rounds
        ),
        "per_round_steal": [(i["steal_frac"], h["steal_frac"]) for i, h, *_ in rounds],
        # What serving adds to a request's latency: HTTP's median minus in process's.
        "ttft_added_ms": http["ttft_p50_ms"] - inproc["ttft_p50_ms"],
        "itl_added_ms": http["itl_p50_ms"] - inproc["itl_p50_ms"],
        "chat": opts.chat,
        # The steadier figure on a noisy machine: CPU each process spent per output token
        # during the HTTP rounds (medians over rounds).
        "http_cpu_ms_per_token": _median_cpu([r[2] for r in rounds]),
        "stream_interval_s": opts.stream_interval,
        "delta_channels": args.delta_channels,
        "serve_env": opts.serve_env,
        "host": cpu_accounting.host_info(),
        "url": base_v1[0],
        "urls": base_v1,
        "http": http,
        "inprocess": inproc,
    }
    if paired is not None:
        result["paired"] = paired
    if spans is not None:
        http_timings = [t for r in rounds for t in r[3]] + paired_http
        result["ttft_stages_ms"] = ttft_stages(spans, http_timings)
    if opts.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{len(items)} requests, {opts.concurrency} concurrent streams, model {opts.model}")
        print(
            f"{'':12}{'tok/s':>9}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>9}"
            f"{'busy':>7}  (ms; busy: engine time in step / wall)"
        )
        for name, r in (("in process", inproc), ("HTTP", http)):
            print(
                f"{name:12}{r['tok_s']:9.1f}{r['ttft_p50_ms']:10.1f}{r['ttft_p99_ms']:9.1f}"
                f"{r['itl_p50_ms']:9.2f}{r['itl_p99_ms']:9.2f}{r['engine_busy_frac']:7.2f}"
            )
        print(f"HTTP / in process: {result['http_over_inprocess']:.3f} (target >= 0.85)")
        print(
            "HTTP / in process per CPU second not stolen by the hypervisor:"
            f" {result['http_over_inprocess_steal_adjusted']:.3f}"
        )
        cpu = ", ".join(f"{n} {ms:.2f}" for n, ms in result["http_cpu_ms_per_token"].items())
        print(f"CPU ms per output token during HTTP rounds: {cpu}")
        print(
            f"added by serving (medians): TTFT {result['ttft_added_ms']:.1f} ms,"
            f" ITL {result['itl_added_ms']:.2f} ms"
        )
        if paired is not None:
            lo, hi = paired["ttft_added_ci95_ms"]
            ilo, ihi = paired["itl_added_ci95_ms"]
            print(
                f"added by serving, {paired['pairs']} prompts each side back to back (medians"
                f" of the differences, 95% interval): TTFT {paired['ttft_added_ms']:.1f} ms"
                f" [{lo:.1f}, {hi:.1f}], ITL {paired['itl_added_ms']:.2f} ms"
                f" [{ilo:.2f}, {ihi:.2f}]"
            )
        if "ttft_stages_ms" in result:
            stages = ", ".join(f"{k} {v:.1f}" for k, v in result["ttft_stages_ms"].items())
            print(f"HTTP TTFT by stage (ms, medians): {stages}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
