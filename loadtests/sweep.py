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
import csv
import ipaddress
import json
import random
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cluster.metrics import percentile
from cluster.workload import CHAT_OUTPUT, CHAT_PROMPT, LengthDist
from engine.core.config import SchedulerConfig
from loadtests.plotting import pyplot

KNEE_SHARE = 0.9


# --------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class PromptSpec:
    kind: str = "chat"  # fixed | uniform | chat | shared-prefix
    prompt_len: int = 128  # fixed; uniform's upper end; shared-prefix's suffix
    output_len: int = 64  # fixed; uniform's upper end
    prefix_len: int = 256  # shared-prefix: the common prefix
    token_lo: int = 32
    token_hi: int = 1000
    max_model_len: int = SchedulerConfig.max_model_len


class PromptSource:
    """Seeded prompts (token ids) and max_tokens; never longer than max_model_len."""

    def __init__(self, spec: PromptSpec, seed: int = 0) -> None:
        if spec.kind not in ("fixed", "uniform", "chat", "shared-prefix"):
            raise ValueError(f"workload must be fixed, uniform, chat or shared-prefix: {spec.kind}")
        self.spec = spec
        self.rng = random.Random(seed)
        self.prefix = self._ids(spec.prefix_len) if spec.kind == "shared-prefix" else []

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.spec.token_lo, self.spec.token_hi) for _ in range(n)]

    def lengths(self) -> tuple[int, int]:
        s = self.spec
        if s.kind == "chat":
            return CHAT_PROMPT.sample(self.rng), CHAT_OUTPUT.sample(self.rng)
        if s.kind == "uniform":
            return (
                LengthDist("uniform", 1, s.prompt_len).sample(self.rng),
                LengthDist("uniform", 1, s.output_len).sample(self.rng),
            )
        return s.prompt_len, s.output_len

    def next(self) -> tuple[list[int], int]:
        n_prompt, n_out = self.lengths()
        room = self.spec.max_model_len - len(self.prefix)
        n_prompt = max(1, min(n_prompt, room - 2))
        n_out = max(1, min(n_out, room - n_prompt))
        return self.prefix + self._ids(n_prompt), n_out


# ------------------------------------------------------------------------ per request
@dataclass
class RequestResult:
    start_s: float  # since the level began
    status: str = "ok"  # ok | 429 | http_<code> | error:<Type>
    ttft_s: float | None = None
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0  # the server's usage count
    tokens_received: int = 0  # summed from per-chunk usage deltas

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else None


async def one_request(
    client, model: str, prompt: list[int], max_tokens: int, t0: float
) -> RequestResult:
    import openai

    started = time.perf_counter()
    res = RequestResult(start_s=started - t0)
    last = started
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for chunk in stream:
            now = time.perf_counter()
            usage = chunk.usage
            if usage is None:
                continue
            new = usage.completion_tokens - seen
            if new > 0:
                if res.ttft_s is None:
                    res.ttft_s = now - started
                    new_gaps = new - 1  # tokens after the first in the first chunk
                else:
                    new_gaps = new
                if new_gaps > 0:
                    res.gaps_s.extend([(now - last) / new] * new_gaps)
                seen = usage.completion_tokens
                last = now
            res.prompt_tokens = usage.prompt_tokens
            res.output_tokens = usage.completion_tokens
        res.tokens_received = seen
    except openai.RateLimitError:
        res.status = "429"
    except openai.APIStatusError as exc:
        res.status = f"http_{exc.status_code}"
    except Exception as exc:  # timeouts, connection resets: counted, never raised
        res.status = f"error:{type(exc).__name__}"
    res.e2e_s = time.perf_counter() - started
    return res


# ----------------------------------------------------------------------------- levels
@dataclass
class LevelResult:
    mode: str  # concurrency | rate
    value: float
    wall_s: float
    requests: list[RequestResult]


class Progress:
    """One line on stderr per level, redrawn as requests complete (no dependency)."""

    def __init__(self, label: str, total_s: float, enabled: bool) -> None:
        self.label, self.total_s, self.enabled = label, total_s, enabled
        self.t0 = time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        frac = min((time.perf_counter() - self.t0) / max(self.total_s, 1e-9), 1.0)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label:>18} [{bar:<30}] {done} done")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def run_level(
    client,
    model: str,
    source: PromptSource,
    mode: str,
    value: float,
    duration_s: float,
    max_requests: int,
    seed: int,
    progress: bool,
) -> LevelResult:
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    results: list[RequestResult] = []
    bar = Progress(f"{mode} {value:g}", duration_s, progress)
    issued = 0

    def take() -> tuple[list[int], int] | None:
        nonlocal issued
        if issued >= max_requests or time.perf_counter() >= deadline:
            return None
        issued += 1
        return source.next()

    async def send(item: tuple[list[int], int]) -> None:
        results.append(await one_request(client, model, item[0], item[1], t0))
        bar.update(len(results))

    if mode == "concurrency":

        async def worker() -> None:
            while (item := take()) is not None:
                await send(item)

        await asyncio.gather(*(worker() for _ in range(int(value))))
    else:
        rng = random.Random(seed)
        tasks = []
        next_at = t0
        while (item := take()) is not None:
            next_at += rng.expovariate(value)
            delay = next_at - time.perf_counter()
            if next_at >= deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(item)))
        await asyncio.gather(*tasks)
    bar.close()
    return LevelResult(mode, value, time.perf_counter() - t0, results)


def summarize(level: LevelResult, slo_ttft_s: float, slo_itl_s: float) -> dict[str, Any]:
    reqs = level.requests
    ok = [r for r in reqs if r.status == "ok"]
    wall = max(level.wall_s, 1e-9)
    good = [
        r
        for r in ok
        if r.ttft_s is not None
        and r.ttft_s <= slo_ttft_s
        and (r.mean_itl_s is None or r.mean_itl_s <= slo_itl_s)
    ]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    e2e = [r.e2e_s for r in ok]
    row: dict[str, Any] = {
        "mode": level.mode,
        "level": level.value,
        "wall_s": level.wall_s,
        "requests": len(reqs),
        "ok": len(ok),
        "errors": sum(1 for r in reqs if r.status not in ("ok", "429")),
        "rejected_429": sum(1 for r in reqs if r.status == "429"),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "tokens_received": sum(r.tokens_received for r in ok),
        "output_tok_s": sum(r.output_tokens for r in ok) / wall,
        "requests_per_s": len(ok) / wall,
        "goodput_requests_per_s": len(good) / wall,
        "goodput_tok_s": sum(r.output_tokens for r in good) / wall,
    }
    for name, values in (("ttft", ttft), ("itl", gaps), ("e2e", e2e)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = 1e3 * percentile(values, q) if values else None
    return row


def knee_index(rows: list[dict[str, Any]]) -> int | None:
    """The first level whose throughput reaches KNEE_SHARE of the best level's."""
    if not rows:
        return None
    best = max(r["output_tok_s"] for r in rows)
    return next(i for i, r in enumerate(rows) if r["output_tok_s"] >= KNEE_SHARE * best)


# ---------------------------------------------------------------------------- outputs
def write_outputs(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2))
    rows = [row | {"variant": name} for name, v in result["variants"].items() for row in v["rows"]]
    if rows:
        with (out / "sweep.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    lines = [
        "# Latency-throughput sweep",
        "",
        f"Target {result['url']}, workload `{result['workload']['kind']}`, SLO: TTFT <= "
        f"{result['slo_ttft_ms']:.0f} ms, mean ITL <= {result['slo_itl_ms']:.0f} ms. "
        "Knee: the first level at >= 90% of the best throughput (marked *).",
        "",
    ]
    for name, v in result["variants"].items():
        lines += [
            f"## {name}",
            "",
            "| level | req | ok | 429 | err | out tok/s | req/s | goodput req/s | TTFT p50/p99 ms "
            "| ITL p50/p99 ms | E2E p50/p99 ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for i, r in enumerate(v["rows"]):
            mark = "*" if i == v["knee"] else ""
            lines.append(
                f"| {r['mode']} {r['level']:g}{mark} | {r['requests']} | {r['ok']} "
                f"| {r['rejected_429']} | {r['errors']} | {r['output_tok_s']:.1f} "
                f"| {r['requests_per_s']:.2f} | {r['goodput_requests_per_s']:.2f} "
                f"| {_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])} "
                f"| {_ms(r['itl_p50_ms'])} / {_ms(r['itl_p99_ms'])} "
                f"| {_ms(r['e2e_p50_ms'])} / {_ms(r['e2e_p99_ms'])} |"
            )
        lines.append("")
    if len(result["variants"]) > 1:
        lines += _ab_table(result)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _plots(result, out)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _ab_table(result: dict[str, Any]) -> list[str]:
    names = list(result["variants"])
    base = names[0]
    lines = [f"## A/B against `{base}` (output tok/s ratio per level)", ""]
    lines += ["| level | " + " | ".join(names[1:]) + " |", "|---" * len(names) + "|"]
    base_rows = result["variants"][base]["rows"]
    for i, row in enumerate(base_rows):
        cells = []
        for name in names[1:]:
            other = result["variants"][name]["rows"]
            ratio = other[i]["output_tok_s"] / row["output_tok_s"] if row["output_tok_s"] else 0
            cells.append(f"{ratio:.2f}x" if i < len(other) else "-")
        lines.append(f"| {row['mode']} {row['level']:g} | " + " | ".join(cells) + " |")
    return lines + [""]


def _plots(result: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, v) in enumerate(result["variants"].items()):
        xs = [r["level"] for r in v["rows"]]
        ax.plot(xs, [r["output_tok_s"] for r in v["rows"]], "o-", color=f"C{i}", label=name)
        if v["knee"] is not None:
            k = v["rows"][v["knee"]]
            ax.plot([k["level"]], [k["output_tok_s"]], "*", color=f"C{i}", markersize=14)
    mode = result["mode"]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency" if mode == "concurrency" else "offered rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for metric, ax in zip(("ttft", "e2e"), axes, strict=True):
        for i, (name, v) in enumerate(result["variants"].items()):
            xs = [r["output_tok_s"] for r in v["rows"]]
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ys = [r[f"{metric}_{q}_ms"] or 0 for r in v["rows"]]
                ax.plot(xs, ys, style, color=f"C{i}", label=f"{name} {q}")
            if v["knee"] is not None:
                ax.axvline(v["rows"][v["knee"]]["output_tok_s"], color=f"C{i}", linestyle=":")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_throughput.png", dpi=100)
    plt.close(fig)


# -------------------------------------------------------------------------------- run
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
    max_len = getattr(served, "max_model_len", None) or spec.max_model_len
    spec = PromptSpec(**(asdict(spec) | {"max_model_len": int(max_len)}))
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
        for name, extra in AB_PRESETS[opts.ab] if opts.ab else [("app", {})]:
            variants[name] = run_started_app(opts, spec, overrides | extra)
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


def run_started_app(
    opts: argparse.Namespace, spec: PromptSpec, overrides: dict[str, Any]
) -> dict[str, Any]:
    """Start deploy.yaml's app with overrides on a local Ray, sweep it, shut it down."""
    import yaml
    from ray import serve

    from serve_app import build_app
    from serve_app.config import AppArgs
    from serve_app.local_cluster import start_local_serve, stop_local_serve

    with open(opts.start_app) as f:
        app_spec = yaml.safe_load(f)["applications"][0]
    args = AppArgs.model_validate(apply_overrides(app_spec["args"], overrides))
    port = start_local_serve(log_level="WARNING")
    try:
        serve.run(build_app(args), name="sweep", route_prefix="/")
        return asyncio.run(sweep_url(f"http://127.0.0.1:{port}", None, spec, opts))
    finally:
        stop_local_serve()
