"""Static vs dynamic batching in the simulator, on memory-constrained GPU settings.

    python -m loadtests.bench_sim paper [--out reports/paper] [--json] [--quick]
    python -m loadtests.bench_sim speed [--no-reference]  # replica-hours per minute
    python -m loadtests.bench_sim cpu            # the same on the real CPU engine (same report)
    python -m loadtests.bench_sim autoscale [--out reports/autoscale] [--duration 1800]
        [--startup-delay 60]                     # see loadtests/bench_autoscale.py
    python -m loadtests.bench_sim disagg [--gpus 4]  # prefill/decode pools vs colocated
    python -m loadtests.bench_sim routing [--gpus 4]  # KV-aware vs hash vs least-loaded
    python -m loadtests.bench_sim migration [--duration 1800]  # drain vs moving the KV

`paper` reproduces the comparison of arXiv 2503.05248 in our own setting (the paper's exact
setup is not public: see ../shared/PAPER_NOTES.md): for each setting, throughput of static
batching at several `max_num_seqs` and of the memory-aware, SLA-feedback and combined policies
on a saturating trace, and capacity (the highest Poisson rate at which >= 90% of requests meet
the SLO) for the best static value and for each dynamic policy. Writes report.md and PNG plots
under --out; --json prints one object with `rows`, `best_throughput_gain`, `capacity_gain`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster.batching import Bounds, MemoryAwareConfig, SlaConfig
from cluster.request_records import Slo
from cluster.sim_config import SimConfig
from cluster.simulator import Simulator, capacity
from cluster.workload import CHAT_OUTPUT, CHAT_PROMPT, make_workload
from engine.core.config import SchedulerConfig
from engine.runner.cost_model import GPUS, MODELS
from loadtests.bench_sim import disagg, migration, routing, speed
from loadtests.bench_sim.report import write_cpu_section, write_report


@dataclass(frozen=True)
class Setting:
    name: str
    config: SimConfig
    static_values: tuple[int, ...]
    saturating_rate: float  # requests/s for the throughput runs (well above capacity)


def paper_settings() -> list[Setting]:
    bounds = Bounds(4, 512)
    slo = Slo(ttft_s=2.0, itl_s=0.1)
    # The SLA policy aims its decode-step latency a little under the ITL objective.
    sla = SlaConfig(target_s=0.08, eps_s=0.01, bounds=bounds)

    def cfg(model, gpu, **kw) -> SimConfig:
        return SimConfig(
            model=model,
            gpu=gpu,
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_model_len=4096),
            memory_aware=MemoryAwareConfig(eta=0.95, bounds=bounds),
            sla=sla,
            slo=slo,
            **kw,
        )

    return [
        Setting(
            "Llama-2-13B, 1x A100-40GB",
            cfg(MODELS["Llama-2-13B"], GPUS["A100-40GB"]),
            (16, 32, 64, 128, 256),
            saturating_rate=12.0,
        ),
        Setting(
            "Llama-3-70B, 4x A100-80GB (TP4)",
            cfg(MODELS["Llama-3-70B"].with_tp(4), GPUS["A100-80GB"]),
            (32, 64, 128, 256, 512),
            saturating_rate=20.0,
        ),
    ]


def run_paper(num_requests: int, capacity_seconds: float, iters: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    gains: dict[str, dict[str, float]] = {}
    for setting in paper_settings():
        trace = make_workload(
            num_requests, setting.saturating_rate, "poisson", CHAT_PROMPT, CHAT_OUTPUT, seed=0
        )

        def make_trace(rate: float, _s=capacity_seconds):
            # A fixed span of arrivals (not a fixed count), so every rate reaches steady state.
            n = max(100, int(rate * _s))
            return make_workload(n, rate, "poisson", CHAT_PROMPT, CHAT_OUTPUT, seed=1)

        static_tp, static_caps = {}, {}
        for b in setting.static_values:
            c = replace(setting.config, policy="static").with_scheduler(max_num_seqs=b)
            s = Simulator(c).run(trace).summary()
            static_tp[b] = s["output_tok_s"]
            static_caps[b] = capacity(c, make_trace, iters=iters)
            rows.append(_row(setting.name, "static", b, s, static_caps[b]))
        best_b = max(static_tp, key=static_tp.get)
        best_cap_b = max(static_caps, key=static_caps.get)
        static_cap = static_caps[best_cap_b]
        best_dyn_tp, best_dyn_cap = 0.0, 0.0
        for policy in ("memory_aware", "sla", "combined"):
            c = replace(setting.config, policy=policy).with_scheduler(
                max_num_seqs=max(setting.static_values)
            )
            s = Simulator(c).run(trace).summary()
            cap = capacity(c, make_trace, iters=iters)
            rows.append(_row(setting.name, policy, None, s, cap))
            best_dyn_tp = max(best_dyn_tp, s["output_tok_s"])
            best_dyn_cap = max(best_dyn_cap, cap)
        gains[setting.name] = {
            "best_static_max_num_seqs": best_b,
            "best_static_capacity_max_num_seqs": best_cap_b,
            "throughput_gain": best_dyn_tp / static_tp[best_b] - 1,
            "capacity_gain": best_dyn_cap / static_cap - 1 if static_cap else float("nan"),
        }
    return {
        "rows": rows,
        "per_setting": gains,
        "best_throughput_gain": max(g["throughput_gain"] for g in gains.values()),
        "capacity_gain": max(g["capacity_gain"] for g in gains.values()),
    }


def _row(setting: str, policy: str, b: int | None, s: dict, cap: float | None = None) -> dict:
    return {
        "setting": setting,
        "policy": policy,
        "static_max_num_seqs": b,
        "output_tok_s": s["output_tok_s"],
        "capacity_rps": cap,
        "ttft_p99_s": s["ttft_p99_s"],
        "itl_p50_s": s["itl_p50_s"],
        "preemptions": s["preemptions"],
        "mean_batch_size": s["mean_batch_size"],
        "mean_kv_usage": s["mean_kv_usage"],
    }


def run_cpu(model: str, num_requests: int, kv_mb: int, statics: tuple[int, ...]) -> dict:
    """The same comparison on the real engine (this CPU, offline mixed-200 prefix, small KV)."""
    from cluster.batching import make_policy
    from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from loadtests.workload import load_workload, resolve_model

    model_dir = resolve_model(model)
    upper = max(statics)
    bounds = Bounds(1, upper)
    runs = [("static", b) for b in statics] + [
        (p, None) for p in ("memory_aware", "sla", "combined")
    ]
    rows = []
    engine = None
    for policy_name, b in runs:
        start_b = b or upper
        config = EngineConfig(
            model=model_dir,
            num_threads=2,
            cache=CacheConfig(
                block_size=16, kv_cache_bytes=kv_mb << 20, enable_prefix_caching=False
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=start_b, max_num_batched_tokens=1024, max_model_len=1024
            ),
        )
        # SLA target: 1.5x the decode step this CPU takes at a quarter of the batch cap.
        policy = make_policy(
            policy_name,
            start_b,
            MemoryAwareConfig(0.95, bounds),
            SlaConfig(target_s=0.3, eps_s=0.03, bounds=bounds),
        )
        engine = LLMEngine(config, policy=policy)
        vocab = engine.runner_vocab_size()
        items = load_workload("mixed-200", vocab, 0, num_requests)
        for it in items:
            engine.add_request(
                it.request_id,
                it.prompt_token_ids,
                SamplingParams(temperature=0.0, max_tokens=it.max_tokens, ignore_eos=True),
            )
        produced, steps, batch = 0, 0, 0
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            outs = engine.step()
            produced += sum(len(o.new_token_ids) for o in outs)
            steps += 1
            batch += engine.stats().last_step_num_seqs
        wall = time.perf_counter() - started
        stats = engine.stats()
        rows.append(
            {
                "policy": policy_name,
                "static_max_num_seqs": b,
                "output_tok_s": produced / wall,
                "preemptions": stats.num_preemptions_total,
                "mean_batch_size": batch / max(steps, 1),
                "kv_blocks": stats.num_total_blocks,
            }
        )
        print(
            f"{policy_name:13} {b or '':>4} {produced / wall:8.1f} tok/s "
            f"preemptions {stats.num_preemptions_total}",
            file=sys.stderr,
        )
    best_static = max(r["output_tok_s"] for r in rows if r["policy"] == "static")
    best_dynamic = max(r["output_tok_s"] for r in rows if r["policy"] != "static")
    return {
        "model": model,
        "num_requests": num_requests,
        "kv_mb": kv_mb,
        "rows": rows,
        "best_throughput_gain": best_dynamic / best_static - 1,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    scenarios = ["paper", "speed", "cpu", "autoscale", "disagg", "routing", "migration"]
    parser.add_argument("scenario", choices=scenarios)
    parser.add_argument("--model", default="small", help="cpu: tiny | small | a checkpoint dir")
    parser.add_argument("--num-requests", type=int, default=48, help="cpu: mixed-200 prefix")
    parser.add_argument("--kv-mb", type=int, default=48, help="cpu: KV cache budget")
    parser.add_argument("--out", default=None, help="reports/<scenario> by default")
    parser.add_argument("--duration", type=float, default=1800.0, help="autoscale: trace s")
    parser.add_argument("--startup-delay", type=float, default=60.0, help="autoscale: replica s")
    parser.add_argument("--gpus", type=int, default=4, help="disagg, routing: GPUs")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke runs)")
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument(
        "--no-reference", action="store_true", help="speed: skip the step-by-step baseline"
    )
    opts = parser.parse_args(argv)
    # The CPU comparison belongs to the paper's report.
    opts.out = opts.out or f"reports/{'paper' if opts.scenario == 'cpu' else opts.scenario}"
    if opts.scenario == "autoscale":
        from loadtests import bench_autoscale

        result = bench_autoscale.run_autoscale(opts.duration, opts.startup_delay, quick=opts.quick)
        bench_autoscale.write_report(result, Path(opts.out))
        if opts.json:
            print(json.dumps({k: v for k, v in result.items() if k != "series"}, indent=2))
        else:
            print((Path(opts.out) / "report.md").read_text())
        return result
    if opts.scenario == "disagg":
        result = disagg.run_disagg(gpus=opts.gpus, quick=opts.quick)
        print(json.dumps(result, indent=2) if opts.json else disagg.describe(result))
        return result
    if opts.scenario == "migration":
        result = migration.run_migration(opts.duration)
        print(json.dumps(result, indent=2) if opts.json else migration.describe(result))
        return result
    if opts.scenario == "routing":
        result = routing.run_routing(gpus=opts.gpus, quick=opts.quick)
        print(json.dumps(result, indent=2) if opts.json else routing.describe(result))
        return result
    if opts.scenario == "speed":
        result = speed.run_speed(opts.hours, opts.rate, not opts.no_reference)
    elif opts.scenario == "cpu":
        result = run_cpu(opts.model, opts.num_requests, opts.kv_mb, (8, 16, 32, 64))
        write_cpu_section(result, Path(opts.out))
    else:
        n, cap_s, iters = (60, 10.0, 3) if opts.quick else (1000, 120.0, 6)
        result = run_paper(n, cap_s, iters)
        write_report(result, Path(opts.out))
    if opts.json:
        print(json.dumps(result, indent=2))
    elif opts.scenario == "cpu":
        print(f"best dynamic over best static: {100 * result['best_throughput_gain']:+.1f}%")
    elif opts.scenario == "speed":
        print(speed.describe(result))
    else:
        print((Path(opts.out) / "report.md").read_text())
    return result
