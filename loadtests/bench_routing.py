"""Routing by what each replica holds (`routing.kv_aware`) against the hash of a prompt's
first `prefix_tokens` tokens (`routing.prefix_affinity`, the default), on multi-turn
conversations that share one system prompt: the share of prompt tokens found in the engine
replicas' prefix caches, TTFT, and preemptions. Two apps of two engine replicas each, the
same but for their routing, on one local Serve; the same conversations go to one, then the
other (`--rounds` alternates them). Each replica runs `--threads` threads (one: a core
apiece, as each would have a GPU of its own; where both used every core, two replicas
prefilling at once would compete for the cores one replica had to itself).

    python -m loadtests.bench_routing [--model small --served-name small --kv-cache-mib 96]
        [--conversations 20] [--turns 3] [--json]

Each conversation's prompts are token ids: the system prompt, then each turn's user message
and a fixed assistant reply, as a replayed trace holds them, so each turn's prompt extends
the last one token for token (the generated tokens are the load, not the history). With one
system prompt longer than `prefix_tokens`, the hash sends every conversation to one replica
until it is `max_imbalance` requests busier than the other, and that replica's cache
(`--kv-cache-mib`) cannot hold them all; routing by the blocks held follows a conversation
to the replica holding its history and places new ones by load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import openai

from cluster.metrics import percentile

APPS = {"hash": {"prefix_affinity": True, "kv_aware": False}, "kv_aware": {"kv_aware": True}}


@dataclass
class RoutingRun:
    """One app's pass over the conversations."""

    router: str
    wall_s: float
    ttft_s: list[float]
    prompt_tokens: int  # looked up in the prefix caches (preempted prompts again)
    cached_tokens: int
    preemptions: int
    busiest_share: float  # of the prompt tokens, the busiest replica's
    # Each replica's prompt tokens looked up and found, busiest first: where a run went
    # wrong, how its prompts split (and whether a replica was replaced mid-run: three rows).
    replicas: list[tuple[int, int]]

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.ttft_s)
        return {
            "router": self.router,
            "requests": len(ttft),
            "wall_s": round(self.wall_s, 2),
            "prefix_hit_rate": round(self.cached_tokens / max(1, self.prompt_tokens), 4),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "preemptions": self.preemptions,
            "busiest_replica_share": round(self.busiest_share, 3),
            "ttft_p50_ms": round(1e3 * percentile(ttft, 50), 1),
            "ttft_p90_ms": round(1e3 * percentile(ttft, 90), 1),
            "ttft_mean_ms": round(1e3 * sum(ttft) / len(ttft), 1),
            "replicas": [list(r) for r in self.replicas],
        }


def conversations(opts: argparse.Namespace, vocab_size: int, seed: int) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn, as token ids (special ids left out); the
    system prompt is the same whatever the seed."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(16, vocab_size) for _ in range(n)]

    system = [random.Random(opts.seed).randrange(16, vocab_size) for _ in range(opts.system_tokens)]
    out = []
    for _ in range(opts.conversations):
        history, prompts = list(system), []
        for turn in range(opts.turns):
            history += text(opts.user_tokens)
            prompts.append(list(history))
            if turn + 1 < opts.turns:
                history += text(opts.reply_tokens)
        out.append(prompts)
    return out


async def converse(
    url: str,
    model: str,
    convs: list[list[list[int]]],
    max_tokens: int,
    think_s: float,
    spread_s: float = 0.0,
):
    """Conversation i from `spread_s` x i on (all at once by default), each turn sent a
    user's think time (`think_s`, 0.5-1.5x of it, drawn) after the last one ended; the
    TTFTs."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    ttfts: list[float] = []

    async def one(index: int, prompts: list[list[int]]) -> None:
        rng = random.Random(index)
        await asyncio.sleep(spread_s * index)
        for turn, prompt in enumerate(prompts):
            if turn:
                await asyncio.sleep(think_s * (0.5 + rng.random()))
            began, first = time.monotonic(), None
            stream = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.monotonic()
            ttfts.append((first or time.monotonic()) - began)

    await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))
    return ttfts


_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions_total")


def replica_counters(app: str) -> dict[str, tuple[int, ...]]:
    """Each engine replica's prefix-cache queries and hits (tokens), and preemptions."""
    from ray import serve

    from loadtests.soak.cli import engine_stats

    handle = serve.get_deployment_handle("EngineServer", app_name=app)  # its one model's
    stats = engine_stats(handle, app)
    assert stats, f"{app}: the engine replicas did not answer"
    return {rid: tuple(s[k] for k in _COUNTERS) for rid, s in stats.items()}


def run_once(app: str, url: str, opts: argparse.Namespace, convs) -> RoutingRun:
    before = replica_counters(app)
    began = time.monotonic()
    ttft = asyncio.run(
        converse(url, opts.served_name, convs, opts.max_tokens, opts.think_s, opts.spread_s)
    )
    wall = time.monotonic() - began
    after = replica_counters(app)
    deltas = [
        [a - b for a, b in zip(counts, before.get(rid, (0,) * len(_COUNTERS)), strict=True)]
        for rid, counts in after.items()
    ]
    queries, hits, preempted = (sum(d[i] for d in deltas) for i in range(len(_COUNTERS)))
    busiest = max(d[0] for d in deltas) / max(1, queries)
    split = sorted(((d[0], d[1]) for d in deltas), reverse=True)
    return RoutingRun(app, wall, ttft, queries, hits, preempted, busiest, split)


def app_args(opts: argparse.Namespace, routing: dict[str, Any]):
    from loadtests.serve_bench import deploy_args
    from loadtests.workload import resolve_model

    overrides = {
        "model": resolve_model(opts.model),
        "served_model_name": opts.served_name,
        "engine.kv_cache_bytes": opts.kv_cache_mib << 20,
        "engine.max_model_len": opts.max_model_len,
        "engine.num_threads": opts.threads or None,
        "engine.speculative.enabled": False,
        "engine.lora.enabled": False,
        "engine.lora.adapters": {},
        "engine_replicas": {"num_replicas": 2, "num_cpus": 0.5},
        "ingress_replicas": {"num_replicas": 1, "num_cpus": 0.25},
        "autoscaling": None,
    }
    overrides |= {f"routing.{k}": v for k, v in routing.items()}
    return deploy_args(opts.deploy_yaml, overrides)


def compare(opts: argparse.Namespace) -> dict[str, Any]:
    """Deploy both apps, run the conversations against each (alternating over rounds, the
    caches warm from round to round as a long-running app's would be), and sum up."""
    from transformers import AutoConfig

    from loadtests.workload import resolve_model
    from serve_app import build_app
    from serve_app.deploy.local_cluster import run_app, start_local_serve, stop_local_serve

    vocab = AutoConfig.from_pretrained(resolve_model(opts.model)).vocab_size
    port = start_local_serve(log_level="WARNING")
    try:
        urls = {}
        for app, routing in APPS.items():
            run_app(build_app(app_args(opts, routing)), app, route_prefix=f"/{app}")
            urls[app] = f"http://127.0.0.1:{port}/{app}"  # through Serve's proxy, both alike
        runs: dict[str, list[RoutingRun]] = {app: [] for app in APPS}
        for round_ in range(opts.rounds):
            # A round's conversations are new (their own seed), their system prompt the same.
            convs = conversations(opts, vocab, seed=opts.seed + 1 + round_)
            order = list(APPS) if round_ % 2 == 0 else list(reversed(APPS))
            for app in order:
                runs[app].append(run_once(app, urls[app], opts, convs))
    finally:
        stop_local_serve()
    return summarize(runs, opts)


def summarize(runs: dict[str, list[RoutingRun]], opts: argparse.Namespace) -> dict[str, Any]:
    merged = {
        app: RoutingRun(
            app,
            sum(r.wall_s for r in rs),
            [t for r in rs for t in r.ttft_s],
            sum(r.prompt_tokens for r in rs),
            sum(r.cached_tokens for r in rs),
            sum(r.preemptions for r in rs),
            max(r.busiest_share for r in rs),
            [row for r in rs for row in r.replicas],
        ).summary()
        for app, rs in runs.items()
    }
    hash_, kv = merged["hash"], merged["kv_aware"]
    return {
        "workload": {
            k: getattr(opts, k)
            for k in (
                "model",
                "conversations",
                "turns",
                "system_tokens",
                "user_tokens",
                "reply_tokens",
                "max_tokens",
                "spread_s",
                "kv_cache_mib",
                "rounds",
            )
        },  # fmt: skip
        "runs": merged,
        "kv_aware_vs_hash": {
            "prefix_hit_rate": round(kv["prefix_hit_rate"] - hash_["prefix_hit_rate"], 4),
            "ttft_p50": round(kv["ttft_p50_ms"] / max(1e-9, hash_["ttft_p50_ms"]), 3),
            "ttft_mean": round(kv["ttft_mean_ms"] / max(1e-9, hash_["ttft_mean_ms"]), 3),
            "wall": round(kv["wall_s"] / max(1e-9, hash_["wall_s"]), 3),
        },
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{'router':10} {'hit rate':>9} {'prompt tok':>11} {'cached':>8} {'busiest':>8} "
        f"{'preempt':>8} {'TTFT p50':>9} {'p90':>8} {'mean':>8} {'wall s':>7}"
    ]
    for r in result["runs"].values():
        lines.append(
            f"{r['router']:10} {r['prefix_hit_rate']:9.1%} {r['prompt_tokens']:11,} "
            f"{r['cached_tokens']:8,} {r['busiest_replica_share']:8.0%} "
            f"{r['preemptions']:8} {r['ttft_p50_ms']:9.1f} "
            f"{r['ttft_p90_ms']:8.1f} {r['ttft_mean_ms']:8.1f} {r['wall_s']:7.1f}"
        )
    vs = result["kv_aware_vs_hash"]
    lines.append(
        f"kv_aware vs hash: hit rate {vs['prefix_hit_rate']:+.1%}, TTFT p50 {vs['ttft_p50']:.2f}x, "
        f"mean {vs['ttft_mean']:.2f}x, wall {vs['wall']:.2f}x"
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_routing", description=__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--served-name", default="tiny")
    p.add_argument("--deploy-yaml", default="deploy.yaml")
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--think-s", type=float, default=1.5, help="a user's pause between turns")
    p.add_argument(
        "--spread-s",
        type=float,
        default=0.0,
        help="conversation i starts this many seconds x i after the first (0: all at once)",
    )
    p.add_argument("--kv-cache-mib", type=int, default=4, help="each engine replica's KV cache")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--threads", type=int, default=1, help="each engine replica's threads (0: every core)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="last line: the result as JSON")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    opts = build_parser().parse_args(argv)
    result = compare(opts)
    print(report(result))
    if opts.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
