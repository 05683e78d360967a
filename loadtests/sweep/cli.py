"""Latency-throughput sweep of a running OpenAI-compatible server (ours or any other).

    python -m loadtests.bench_serve sweep --url http://127.0.0.1:8000 --concurrency 1,2,4,8
    python -m loadtests.bench_serve sweep --url ... --rate 1,2,4 --slo-ttft-ms 1000
    python -m loadtests.bench_serve sweep --start-app deploy.yaml --ab batching --concurrency 4,16

Each level is a closed loop (`--concurrency C`: C clients, each sending its next request when
the last one ends) or an open loop (`--rate R`: Poisson arrivals at R requests/s), for at most
`--level-duration` seconds and `--max-requests` requests; requests still running at the end are
awaited (bounded by `--request-timeout`). Requests stream through the real `openai` client
with usage on every chunk, so tokens are counted exactly: per request TTFT, every inter-token
gap (a chunk of k tokens after a gap g counts k gaps of g / k), E2E, tokens in and out, status.

Per level: output tokens/s, requests/s, TTFT/ITL/E2E p50/p90/p99, errors and 429s, goodput
(requests/s and output tokens/s of requests within `--slo-ttft-ms` and `--slo-itl-ms`), and the
knee (the first level reaching 90% of the best throughput: beyond it latency grows for little
throughput). Writes sweep.json, sweep.csv, report.md and PNGs under --out.

Prompts are token ids drawn from `--token-range` (seeded), so lengths are exact on any model:
`fixed`, `uniform`, `chat` (lognormal, ShareGPT-like means) or `shared-prefix` (a common
prefix and unique suffixes). Only loopback URLs unless `--allow-remote`.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import urllib.parse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtests.sweep.level import run_level
from loadtests.sweep.prompt_source import PromptSource, PromptSpec
from loadtests.sweep.report import knee_index, summarize, write_outputs


def check_loopback(url: str) -> None:
    host = urllib.parse.urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"{url} is not a loopback address; pass --allow-remote to load it")


async def sweep_url(
    url: str, model: str | None, spec: PromptSpec, opts: argparse.Namespace
) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=url.rstrip("/") + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=opts.request_timeout,
    )
    models = await client.models.list()
    served = models.data[0]
    model = model or served.id
    max_len = getattr(served, "max_model_len", None) or spec.context_len
    spec = PromptSpec(**(asdict(spec) | {"context_len": int(max_len)}))
    mode, levels = ("rate", opts.rate) if opts.rate else ("concurrency", opts.concurrency)
    rows = []
    for i, value in enumerate(levels):
        source = PromptSource(spec, seed=opts.seed + i)
        level = await run_level(
            client,
            model,
            source,
            mode,
            value,
            opts.level_duration,
            opts.max_requests,
            opts.seed + i,
            not opts.no_progress,
        )
        rows.append(summarize(level, opts.slo_ttft_ms / 1e3, opts.slo_itl_ms / 1e3))
    await client.close()
    return {"model": model, "rows": rows, "knee": knee_index(rows)}


def parse_levels(text: str | None, cast) -> list:
    if not text:
        return []
    values = [cast(x) for x in text.split(",") if x.strip()]
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"levels must be positive numbers: {text!r}")
    return values


AB_PRESETS = {
    "batching": [
        ("continuous", {"engine.batching": "continuous"}),
        ("static", {"engine.batching": "static"}),
    ],
    "policies": [
        (p, {"batching.policy": p}) for p in ("static", "memory_aware", "sla", "combined")
    ],
}


def parse_override(text: str) -> dict[str, Any]:
    """KEY=VALUE (dotted key into deploy.yaml's args; VALUE parsed as YAML)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"override must be KEY=VALUE: {text!r}")
    return {key.strip(): yaml.safe_load(value)}


def apply_overrides(args: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(args))
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise SystemExit(f"override {dotted}: {p} is not a section")
        node[leaf] = value
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_serve sweep", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--rate", default=None, help="open loop: requests/s levels")
    parser.add_argument("--level-duration", type=float, default=20.0)
    parser.add_argument("--max-requests", type=int, default=1000, help="per level")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument(
        "--workload", default="chat", choices=["fixed", "uniform", "chat", "shared-prefix"]
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--token-range", default="32,1000", help="prompt token ids: lo,hi")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="reports/sweep")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--allow-remote", action="store_true")
    parser.add_argument("--start-app", default=None, help="deploy.yaml: start it locally")
    parser.add_argument(
        "--override", action="append", default=[], type=parse_override, help="KEY=VALUE"
    )
    parser.add_argument("--ab", choices=sorted(AB_PRESETS), default=None, help="with --start-app")
    opts = parser.parse_args(argv)
    opts.concurrency = parse_levels(opts.concurrency, int)
    opts.rate = parse_levels(opts.rate, float)
    lo, hi = (int(x) for x in opts.token_range.split(","))
    spec = PromptSpec(opts.workload, opts.prompt_len, opts.output_len, opts.prefix_len, lo, hi)
    overrides: dict[str, Any] = {}
    for o in opts.override:
        overrides.update(o)
    if opts.ab and not opts.start_app:
        raise SystemExit("--ab needs --start-app (the tool starts each variant itself)")
    variants: dict[str, dict[str, Any]] = {}
    if opts.start_app:
        presets = AB_PRESETS[opts.ab] if opts.ab else [("app", {})]
        variants = run_started_apps(opts, spec, {n: overrides | x for n, x in presets})
        url = "(apps started by the tool)"
    else:
        if not opts.allow_remote:
            check_loopback(opts.url)
        variants["server"] = asyncio.run(sweep_url(opts.url, opts.model, spec, opts))
        url = opts.url
    result = {
        "url": url,
        "mode": "rate" if opts.rate else "concurrency",
        "workload": asdict(spec),
        "slo_ttft_ms": opts.slo_ttft_ms,
        "slo_itl_ms": opts.slo_itl_ms,
        "overrides": overrides,
        "variants": variants,
    }
    write_outputs(result, Path(opts.out))
    if opts.json:
        print(json.dumps(result, indent=2))
    else:
        print((Path(opts.out) / "report.md").read_text())
    return result


def run_started_apps(
    opts: argparse.Namespace, spec: PromptSpec, overrides: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """On one local Ray, each variant in turn: deploy.yaml's app with the variant's overrides
    started, swept and deleted (the next variant starts on an idle cluster)."""
    import yaml
    from ray import serve

    from serve_app import build_app
    from serve_app.config import AppArgs
    from serve_app.deploy.local_cluster import run_app, start_local_serve, stop_local_serve

    with open(opts.start_app) as f:
        app_spec = yaml.safe_load(f)["applications"][0]
    variants = {}
    port = start_local_serve(log_level="WARNING")
    try:
        for name, extra in overrides.items():
            args = AppArgs.model_validate(apply_overrides(app_spec["args"], extra))
            run_app(build_app(args), "sweep")
            variants[name] = asyncio.run(sweep_url(f"http://127.0.0.1:{port}", None, spec, opts))
            serve.delete("sweep")
    finally:
        stop_local_serve()
    return variants
