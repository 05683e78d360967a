"""Where the paper's rules earn their place: untuned dynamic batching against static batching,
default and tuned, on autoscaled fleets in the simulator.

    python -m loadtests.bench_tune [--trials 24] [--duration 1200] [--out reports/tune_table]
    python -m loadtests.bench_tune --ray [--duration 1200] [--rate 40]

(--ray: the tuner's speed in local processes against Ray tasks, loadtests/tune_pool_speed.py.)

For each model x GPU and each workload (cluster.workload.named_workload: chat, long-prompt,
bursty, diurnal; rates in units of one replica's capacity, measured first), four kinds of
setting serve the same trace under the same queue-depth autoscaling rule:
- default static: deploy.yaml's defaults (max_num_seqs 128, max_num_batched_tokens 2048);
- tuned static: the cheapest static setting meeting the target over the whole grid of
  max_num_seqs x max_num_batched_tokens (`cluster.tune`'s search; the highest attainment
  if none meets it);
- memory_aware, sla, combined: each policy with its default parameters, run by the cluster
  controller as deployed.
All of them scale with the rule's default knobs, starting from as many replicas as the
load needs with a quarter of headroom (one for diurnal), so the batching rules differ.
Each row: replica-hours, SLO attainment (TTFT <= 2 s and ITL <= 100 ms), whether it meets
the 90% target, and its replica-hours against the tuned static's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cluster.request_records import Slo
from cluster.sim_config import SimConfig
from cluster.simulator import capacity
from cluster.tune.problem import Problem
from cluster.tune.report import Target, cheapest
from cluster.tune.search import search
from cluster.tune.space import Setting, Space
from cluster.tune.trial_pool import LocalPool, TrialPool
from cluster.workload import make_workload, named_workload
from engine.runner.cost_model import GPUS, MODELS, CostParams
from loadtests import tune_pool_speed

TARGET = Target(Slo(ttft_s=2.0, itl_s=0.1), attainment=0.9)
REPLICAS = (("Llama-2-7B", "A100-80GB"), ("Llama-2-13B", "A100-40GB"))
# Mean load in replica capacities (diurnal: at the peak).
LOADS = {"chat": 3.0, "long-prompt": 3.0, "bursty": 3.0, "diurnal": 4.0}
STATIC_SPACE = {
    "max_num_seqs": [16, 32, 64, 128, 256, 512],
    "max_num_batched_tokens": [1024, 2048, 4096, 8192],
}


def replica_capacity(model: str, gpu: str) -> float:
    """Requests/s one replica serves with >= 90% within the target (chat, default knobs)."""
    config = SimConfig(MODELS[model], GPUS[gpu], slo=TARGET.slo).with_scheduler(max_num_seqs=128)
    return capacity(config, lambda r: make_workload(int(r * 120), rate=r, seed=1), 2.0, iters=4)


def _row(kind: str, trial: dict[str, Any], tuned: dict[str, Any] | None) -> dict[str, Any]:
    rh = trial["replica_hours"]
    return {
        "kind": kind,
        "replica_hours": rh,
        "sla_attainment": trial["sla_attainment"],
        "meets": TARGET.met(trial),
        "vs_tuned": rh / tuned["replica_hours"] - 1 if tuned else None,
        "setting": trial["setting"],
    }


def run(trials: int, duration_s: float, out: Path, pool: TrialPool) -> dict[str, Any]:
    rows = []
    started = time.perf_counter()
    for model, gpu in REPLICAS:
        cap = replica_capacity(model, gpu)
        for workload, load in LOADS.items():
            trace = named_workload(workload, load * cap, duration_s, seed=0)
            problem = Problem(trace, MODELS[model], GPUS[gpu], CostParams(), TARGET.slo)
            found, _ = search(problem, Space.of(STATIC_SPACE), trials, out / "trials.jsonl", pool)
            tuned = cheapest(found, TARGET) or max(found, key=lambda t: t["sla_attainment"])
            kinds = [("default static", Setting())]
            kinds += [
                (p, replace(Setting(), policy=p)) for p in ("memory_aware", "sla", "combined")
            ]
            head = {"model": model, "gpu": gpu, "workload": workload, "capacity_rps": cap}
            rows.append(head | _row("tuned static", tuned, tuned))
            for kind, setting in kinds:
                rows.append(head | _row(kind, problem.trial(setting), tuned))
            print(f"{model} {gpu} {workload}: done at {time.perf_counter() - started:.0f} s",
                  file=sys.stderr)  # fmt: skip
    return {
        "rows": rows,
        "trials": trials,
        "duration_s": duration_s,
        "wall_s": time.perf_counter() - started,
    }


def write_report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Dynamic batching, untuned, against static batching, default and tuned",
        "",
        f"Target: {TARGET.describe()}. Traces of {result['duration_s']:.0f} s; tuned static: "
        f"the cheapest of {result['trials']} static settings meeting it (else the best).",
        "",
        "| model, GPU | workload | setting | replica-hours | attainment | meets | vs tuned |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        vs = "" if r["kind"] == "tuned static" else f"{100 * r['vs_tuned']:+.1f}%"
        lines.append(
            f"| {r['model']}, {r['gpu']} | {r['workload']} | {r['kind']} "
            f"| {r['replica_hours']:.2f} | {100 * r['sla_attainment']:.1f}% "
            f"| {'yes' if r['meets'] else 'no'} | {vs} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=24, help="static settings (24: all)")
    parser.add_argument("--duration", type=float, default=1200.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="reports/tune_table")
    parser.add_argument("--ray", action="store_true", help="local processes against Ray tasks")
    parser.add_argument("--rate", type=float, default=40.0, help="--ray: the trace's req/s")
    opts = parser.parse_args(argv)
    out = Path(opts.out)
    if opts.ray:
        result = tune_pool_speed.run(opts.duration, opts.rate, out)
        tune_pool_speed.write_report(result, out)
        print((out / "pools.md").read_text())
        return result
    with LocalPool(opts.workers) as pool:
        result = run(opts.trials, opts.duration, out, pool)
    write_report(result, out)
    print((out / "report.md").read_text())
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
