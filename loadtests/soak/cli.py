"""Soak: mixed load for a long time against the app on a local Ray, and what it leaves behind.

    python -m loadtests.soak [--duration 3600] [--kill-every 600] [--out reports/soak] [--json]

Starts Ray and the app of deploy.yaml (2 engine replicas, fast health checks), records every
prompt's greedy answer from the undisturbed server, then for `--duration` seconds keeps
`--concurrency` clients busy with a mix of streams, whole completions, streamed chats, aborted
streams, clients that leave before the answer and bad bodies (loadtests/soak/load.py), adds a
burst of `--burst-size` streams every `--burst-every` seconds, and SIGKILLs an engine replica
every `--kill-every` seconds (Serve starts another). Reports requests by kind and outcome,
`lost` (valid requests that failed), `hung` (not ended within `--deadline`), `wrong` (another
text than the undisturbed answer, or a bad body not refused as it should be), every
process's RSS over time and its growth once warm (loadtests/soak/watch.py; `rss.png`), and
whether every KV block was free at the end. A watchdog takes py-spy stacks of every process
of the cluster while a request outlives its deadline (`<out>/stacks/`). With `--json` the last
line is one JSON object (also written to `<out>/result.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from loadtests.soak.load import KINDS, Clients, Outcome, prompt_pool
from loadtests.soak.watch import MemorySeries, StackCapture

APP = "soak"
# The app of deploy.yaml with the chaos suite's health checks (a killed replica is noticed in
# about a second) and two engine replicas, so a kill leaves one serving.
OVERRIDES: dict[str, Any] = {
    "engine_replicas": {"num_replicas": 2, "num_cpus": 0.5},
    "ingress_replicas": {"num_replicas": 1, "num_cpus": 0.25},
    "health": {"check_period_s": 1, "check_timeout_s": 2},
    "request_timeout_s": 60,
    "autoscaling": None,  # a fixed replica count, so that each kill leaves one serving
}
REPLICAS = OVERRIDES["engine_replicas"]["num_replicas"]


def app_args(model: str) -> dict[str, Any]:
    import yaml

    with open(Path(__file__).resolve().parents[2] / "deploy.yaml") as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    return args | OVERRIDES | {"model": model, "served_model_name": "soak"}


def engine_stats(
    handle, app: str = APP, count: int | None = None, timeout: float = 60.0
) -> dict[str, dict]:
    """Stats of every live engine replica of `handle`'s deployment in `app`, each asked by its
    id (the router sends a plain call to the least loaded replica, so polling could miss a
    busy one); {} unless all of them (and `count` of them, when given) answer within
    `timeout`."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{handle.deployment_name}#"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = ray.util.list_named_actors(all_namespaces=True)  # the live ones
        ids = [n["name"][len(prefix) :] for n in names if n["name"].startswith(prefix)]
        seen = {}
        for rid in ids:
            try:
                stats = handle.stats.remote(replica_id=rid).result(timeout_s=5)
            except Exception:  # dying, or not yet serving
                continue
            if stats["replica_id"] == rid:
                seen[rid] = stats
        if ids and len(seen) == len(ids) and count in (None, len(ids)):
            return seen
        time.sleep(0.5)
    return {}


async def kill_one(handle, kills: list[dict], start: float) -> None:
    """SIGKILL the longest-lived engine replica."""
    stats = await asyncio.to_thread(engine_stats, handle, APP, REPLICAS)
    if not stats:
        kills.append({"t": round(time.monotonic() - start), "error": "no replica answered"})
        return
    oldest = min(stats.values(), key=lambda s: psutil.Process(s["pid"]).create_time())
    os.kill(oldest["pid"], signal.SIGKILL)
    kills.append({"t": round(time.monotonic() - start), "pid": oldest["pid"]})


async def blocks_free(handle, timeout: float = 90.0) -> tuple[bool, dict[str, dict]]:
    """Whether every engine replica ends with no KV block used and no stream open."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await asyncio.to_thread(engine_stats, handle, APP, REPLICAS, timeout)
        free = bool(stats) and all(
            s["num_used_blocks"] == 0 and s["num_streams"] == 0 for s in stats.values()
        )
        if free or time.monotonic() > deadline:
            keys = ("num_used_blocks", "num_free_blocks", "num_streams", "num_preemptions_total")
            return free, {r: {k: s.get(k) for k in keys} for r, s in stats.items()}
        await asyncio.sleep(1.0)


async def soak(opts: argparse.Namespace, base: str, handle) -> dict[str, Any]:
    clients = Clients(base, "soak", prompt_pool(opts.prompts, opts.seed), opts.deadline)
    await clients.references()
    memory = MemorySeries()
    stacks = StackCapture(Path(opts.out) / "stacks")
    outcomes: list[Outcome] = []
    kills: list[dict] = []
    start = time.monotonic()
    stop_at = start + opts.duration
    weights = list(KINDS.values())

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            kind = rng.choices(list(KINDS), weights)[0]
            outcomes.append(await clients.send(kind, rng))

    burst_rng = random.Random(opts.seed)

    async def burst() -> None:
        sends = [clients.send("stream", burst_rng, "burst") for _ in range(opts.burst_size)]
        outcomes.extend(await asyncio.gather(*sends))

    async def every(period: float, action) -> None:
        """`action` at start + period, + 2 period, ... before the end (on time, whatever the
        one before took; one that ran past its successor's time is followed at once)."""
        due = start + period
        while due < stop_at:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            await action()
            due += period

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(1.0)
            if clients.oldest_age() > opts.deadline and stacks.due():
                reason = f"a request in flight for {clients.oldest_age():.0f} s"
                print(f"watchdog: {reason}: taking stacks", file=sys.stderr)
                await asyncio.to_thread(stacks.capture, reason)

    background = [
        asyncio.create_task(every(opts.sample_every, lambda: asyncio.to_thread(memory.sample))),
        asyncio.create_task(watchdog()),
    ]
    if opts.kill_every:
        background.append(
            asyncio.create_task(every(opts.kill_every, lambda: kill_one(handle, kills, start)))
        )
    memory.sample()
    load = [client(opts.seed + 1 + c) for c in range(opts.concurrency)]
    if opts.burst_every:
        load.append(every(opts.burst_every, burst))
    await asyncio.gather(*load)
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    seconds = time.monotonic() - start
    memory.sample()
    free, end_stats = await blocks_free(handle)
    await clients.close()
    result = report(opts, outcomes, kills, memory, stacks, free, end_stats, seconds)
    write(Path(opts.out), result, memory)
    return result


def write(out: Path, result: dict[str, Any], memory: MemorySeries) -> None:
    """result.json, rss.json (each role's summed RSS over time) and rss.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    series = memory.by_role()
    (out / "rss.json").write_text(json.dumps(series))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(11, 5))
    for role, points in series.items():
        ax.plot([t / 60 for t, _ in points], [mb for _, mb in points], label=role)
    for kill in result["kills"]:
        ax.axvline(kill["t"] / 60, color="grey", linestyle=":", linewidth=0.8)
    ax.set(xlabel="minutes", ylabel="RSS (MB, summed over a role's processes)")
    ax.set_title("soak: resident memory by process role (dotted: replica killed)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=110)
    plt.close(fig)


def report(opts, outcomes, kills, memory, stacks, free, end_stats, seconds) -> dict[str, Any]:
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.status] += 1
    totals = Counter(o.status for o in outcomes)
    growth = memory.growth(opts.warmup)
    max_growth = max((r["growth_mb"] for r in growth), default=0.0)
    return {
        "duration_s": round(seconds),
        "requests": len(outcomes),
        "lost": totals["lost"],
        "hung": totals["hung"],
        "wrong": totals["wrong"],
        "rejected": totals["rejected"],
        "outcomes": dict(totals),
        "by_kind": {k: dict(c) for k, c in sorted(by_kind.items())},
        "kills": kills,
        "blocks_free": free,
        "engine_replicas_at_end": end_stats,
        "rss_bound_mb": opts.rss_bound_mb,
        "rss_max_growth_mb": max_growth,
        "rss_ok": max_growth <= opts.rss_bound_mb,
        "rss_growth": growth[:12],
        "stacks": stacks.captures,
        "failures": [
            f"{o.kind} {o.status} {o.seconds:.1f}s {o.detail}"
            for o in outcomes
            if o.status in ("lost", "hung", "wrong")
        ][:20],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--burst-every", type=float, default=120.0, help="0: no bursts")
    parser.add_argument("--burst-size", type=int, default=64)
    parser.add_argument("--kill-every", type=float, default=600.0, help="0: no kills")
    parser.add_argument("--deadline", type=float, default=60.0, help="a request's seconds")
    parser.add_argument("--warmup", type=float, default=300.0, help="RSS judged after this")
    parser.add_argument("--rss-bound-mb", type=float, default=64.0)
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="reports/soak")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    opts = parse(argv)
    from ray import serve

    from serve_app import build_app
    from serve_app.config import AppArgs
    from serve_app.deploy.local_cluster import run_app, start_local_serve, stop_local_serve

    args = AppArgs.model_validate(app_args(str(Path(opts.model).resolve())))
    port = start_local_serve(log_level="WARNING")
    try:
        run_app(build_app(args), APP, f"/{APP}")
        handle = serve.get_deployment_handle("EngineServer", app_name=APP)
        base = f"http://127.0.0.1:{port}/{APP}/v1"
        result = asyncio.run(soak(opts, base, handle))
    finally:
        stop_local_serve()
    print(json.dumps(result) if opts.json else json.dumps(result, indent=1))
    return result
