"""Tune batching and autoscaling for your own traffic in the simulator.

    python -m cluster.tune --trace trace.jsonl --slo ttft=2 --slo itl=0.1 [--attainment 0.9]
    python -m cluster.tune --workload diurnal --rate 30 --duration 3600 --slo ttft=2 ...
    python -m cluster.tune --from-url http://head:8000/llm [--since 24h] --slo ttft=2 ...
        [--model Llama-2-7B [--model SERVED=NAME ...] --gpu A100-80GB
         | --calibration calibration.json]
        [--set max_num_seqs=64,128,256 --set policy=static,combined --set max_replicas=8 ...]
        [--trials 40] [--workers 2 | --ray [ADDRESS]] [--apply URL] [--out reports/tune] [--json]

The trace is JSONL (`arrival_s`, `prompt_len`, `output_len` per line: cluster/trace_file.py), a
named generator, or what a running app recorded of its own traffic (GET /v1/cluster/trace,
saved as trace.jsonl under --out). A trace with a `model` column (an app serving several
models) is tuned model by model, each on its own replicas (`--model SERVED=NAME` gives each its
cost model), and tuned.yaml holds deploy.yaml's `models:` entries. A setting runs the real
scheduler over the trace on a fleet of simulated replicas (cluster/cluster_sim.py); `--trials`
whole-trace runs are the budget of the search (cluster/tune/search.py: successive halving where
the grid is larger). SLOs: per-request objectives (ttft, itl, e2e, in seconds) that
`--attainment` of requests must meet, and percentiles (ttft_p99, ...) that must not exceed
their value. Knobs: cluster/tune_space.Setting (one value fixes a knob). Prints the Pareto
front of replica-hours against attainment, writes the cheapest setting that meets the target as
deploy.yaml `args:` (tuned.yaml), report.md, front.png and replicas.png under --out;
`--apply URL` applies it to the running app at URL without a redeploy (POST
/v1/cluster/settings: the batching and autoscaling knobs that change live).
Trials run in --workers local processes, or with --ray as Ray tasks across a cluster (ADDRESS,
else the cluster RAY_ADDRESS or `ray start` names, else a new local one; cluster/tune/ray_pool.py):
the same trials either way for the same --seed and --trials. Ctrl-C stops the search and
reports on the trials so far.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from cluster.request_records import Slo
from cluster.trace_file import TraceError, load_trace
from cluster.tune.app_client import apply_settings, fetch_trace
from cluster.tune.problem import Problem
from cluster.tune.report import PERCENTILES, Target, cheapest, write
from cluster.tune.search import plan, search
from cluster.tune.space import DEFAULT_SPACE, Setting, Space, parse_knob
from cluster.tune.trial_pool import LocalPool, TrialPool
from cluster.workload import NAMED_WORKLOADS, SimRequest, named_workload
from engine.runner.cost_model import GPUS, MODELS, CostParams, GpuSpec, ModelSpec


def parse_target(slos: list[str], attainment: float) -> Target:
    per_request = {"ttft": math.inf, "itl": math.inf, "e2e": math.inf}
    percentiles: dict[str, float] = {}
    for text in slos:
        name, _, value = text.partition("=")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"--slo {text!r}: expected NAME=SECONDS") from None
        if name in per_request:
            per_request[name] = limit
        elif f"{name}_s" in PERCENTILES:
            percentiles[f"{name}_s"] = limit
        else:
            names = list(per_request) + [p.removesuffix("_s") for p in PERCENTILES]
            raise ValueError(f"--slo {name!r}: one of {', '.join(names)}")
    if not slos:
        raise ValueError("--slo: give at least one objective, e.g. --slo ttft=2 --slo itl=0.1")
    if not 0 < attainment <= 1:
        raise ValueError("--attainment: a share in (0, 1]")
    slo = Slo(per_request["ttft"], per_request["itl"], per_request["e2e"])
    return Target(slo, attainment, percentiles)


def replica_spec(opts, model_name: str) -> tuple[ModelSpec, GpuSpec, CostParams, str]:
    if opts.calibration:
        cal = json.loads(Path(opts.calibration).read_text())
        model = ModelSpec.from_hf_config(cal["model"], dtype_bytes=4)
        gpu = GpuSpec(**cal["device"])
        return model, gpu, CostParams(**cal["params"]), f"{cal['model']} on {gpu.name} (calibrated)"
    if model_name not in MODELS or opts.gpu not in GPUS:
        raise ValueError(f"--model one of {list(MODELS)}; --gpu one of {list(GPUS)}")
    return MODELS[model_name], GPUS[opts.gpu], CostParams(), f"{model_name} on {opts.gpu}"


def cost_models(texts: list[str], served: list[str | None]) -> dict[str | None, str]:
    """The cost model of each served model: `--model NAME` for all, `--model SERVED=NAME`
    for one (the trace's `model` column names the served models)."""
    default, named = "Llama-2-7B", {}
    for text in texts:
        who, _, name = text.rpartition("=")
        if who:
            named[who] = name
        else:
            default = name
    unknown = set(named) - set(served)
    if unknown:
        raise ValueError(f"--model {sorted(unknown)[0]}=...: the trace names no such model")
    return {who: named.get(who or "", default) for who in served}


def by_model(trace: list[SimRequest]) -> dict[str | None, list[SimRequest]]:
    """The trace's requests per served model (its `model` column); {None: trace} without one."""
    groups: dict[str | None, list[SimRequest]] = {}
    for request in trace:
        groups.setdefault(request.model, []).append(request)
    if None in groups and len(groups) > 1:
        raise ValueError("--trace: some rows name a `model` and some do not")
    return dict(sorted(groups.items(), key=lambda kv: kv[0] or ""))


def _pool(opts):
    """Where the trials run: Ray tasks (--ray) or local processes (--workers)."""
    if opts.ray is None:
        return LocalPool(opts.workers or os.cpu_count() or 1)
    from cluster.tune.ray_pool import RayPool  # only a --ray search needs Ray

    return RayPool(opts.ray or None, opts.workers)


def _share(fraction: float) -> str:
    return "the whole trace" if fraction == 1.0 else f"the trace {round(1 / fraction)}x faster"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="JSONL: arrival_s, prompt_len, output_len per line")
    source.add_argument("--workload", choices=NAMED_WORKLOADS)
    source.add_argument(
        "--from-url", help="a running app (e.g. http://head:8000/llm): its recorded traffic"
    )
    parser.add_argument("--since", default="24h", help="--from-url: 24h, 30m, or epoch seconds")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("DYNABATCH_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="--from-url, --apply: the app's API key (default: $DYNABATCH_API_KEY, "
        "$OPENAI_API_KEY)",
    )
    parser.add_argument(
        "--apply",
        metavar="URL",
        help="apply the chosen setting to the app at URL live (POST /v1/cluster/settings)",
    )
    parser.add_argument("--rate", type=float, default=20.0, help="--workload: requests/s")
    parser.add_argument("--duration", type=float, default=1800.0, help="--workload: seconds")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help=f"NAME or SERVED=NAME (one per served model of the trace), NAME one of {list(MODELS)}",
    )
    parser.add_argument("--gpu", default="A100-80GB", help=f"one of {list(GPUS)}")
    parser.add_argument("--calibration", help="a loadtests.calibrate JSON (model and device)")
    parser.add_argument("--slo", action="append", default=[], help="ttft=S, itl=S, e2e=S, ...")
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--set", action="append", default=[], help="KNOB=V1,V2,...")
    parser.add_argument("--trials", type=int, default=40, help="per served model")
    parser.add_argument(
        "--workers", type=int, help="local processes (default: the CPUs); with --ray, in flight"
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run the trials as Ray tasks on this cluster (no ADDRESS: RAY_ADDRESS or local)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="reports/tune")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON last")
    opts = parser.parse_args(argv)
    try:
        target = parse_target(opts.slo, opts.attainment)
        knobs = dict(DEFAULT_SPACE)
        knobs.update(parse_knob(text) for text in opts.set)
        space = Space.of(knobs)
        points = space.points()
        for p in (points[0], points[-1]):
            space.setting(p).check()
        if opts.from_url:
            saved = fetch_trace(opts.from_url, opts.since, opts.api_key, Path(opts.out))
            trace, what = load_trace(saved), f"{opts.from_url}'s traffic since {opts.since}"
        elif opts.trace:
            trace, what = load_trace(opts.trace), opts.trace
        else:
            trace = named_workload(opts.workload, opts.rate, opts.duration, opts.seed)
            what = f"{opts.workload} at {opts.rate:g} req/s for {opts.duration:g} s"
        groups = by_model(trace)
        costs = cost_models(opts.model, list(groups))
        specs = {who: replica_spec(opts, name) for who, name in costs.items()}
    except (ValueError, TraceError, OSError) as exc:
        parser.error(str(exc))
    out = Path(opts.out)
    with _pool(opts) as pool:
        if None in groups:
            result = _tune(opts, target, space, trace, what, specs[None], out, pool)
        else:  # each model on its own replicas: its own requests, its own search
            results = {
                who: _tune(
                    opts, target, space, rows, f"{what}, {who}", specs[who], out / _slug(who), pool
                )
                for who, rows in groups.items()
                if who is not None
            }
            _write_models(out, results)
            result = {"models": results}
        if opts.ray is not None:
            result["ray"] = {"nodes": len(pool.nodes), "rerun": pool.rerun}
            print(
                f"Ray: trials ran on {len(pool.nodes)} nodes; {pool.rerun} re-run after their "
                "worker or node was lost",
                file=sys.stderr,
            )
    if opts.apply:
        result["applied"] = _apply(opts.apply, opts.api_key, result)
    if opts.json:
        print(json.dumps(result, default=str))
    return result


def _apply(url: str, api_key: str | None, result: dict[str, Any]) -> dict[str, Any]:
    """Each chosen setting applied to the app at `url`: per model, the settings now in force
    or why the app refused them."""
    chosen = result.get("models", {None: result})
    applied: dict[str, Any] = {}
    for who, found in chosen.items():
        label = who or "the app"
        if found.get("chosen") is None:
            print(f"--apply: nothing to apply for {label} (no setting met the target)")
            continue
        args = Setting(**found["chosen"]["setting"]).deploy_args()
        try:
            in_force = apply_settings(url, args, api_key, who)
        except ValueError as exc:
            print(f"--apply: {label} refused: {exc}", file=sys.stderr)
            applied[str(who)] = {"error": str(exc)}
            continue
        print(f"--apply: {label} now runs settings version {in_force['version']} at {url}")
        applied[str(who)] = in_force
    return applied


def _tune(
    opts,
    target: Target,
    space: Space,
    trace: list[SimRequest],
    what: str,
    spec: tuple[ModelSpec, GpuSpec, CostParams, str],
    out: Path,
    pool: TrialPool,
) -> dict[str, Any]:
    """One search over `trace` on replicas of `spec`, reported under `out`."""
    model, gpu, cost, replica_name = spec
    title = f"{what} ({len(trace)} requests), {replica_name}"
    rounds = plan(space.size, opts.trials)
    runs = sum(count for count, _ in rounds)
    how = "each on the whole trace"
    if len(rounds) > 1:
        rungs = ", ".join(f"{count} on {_share(fraction)}" for count, fraction in rounds[:-1])
        how = f"successive halving ({rungs}), then up to {rounds[-1][0]} around the front"
    print(f"{title}: {space.size} settings; {how}", file=sys.stderr)
    problem = Problem(trace, model, gpu, cost, target.slo)
    started = time.perf_counter()
    count = [0]

    def progress(trial: dict[str, Any]) -> None:
        count[0] += 1
        rate = trial["replica_hours"] / max(trial["wall_s"], 1e-9) * 60
        print(
            f"\r[{count[0]}/{runs}] {time.perf_counter() - started:.0f} s; last on "
            f"{_share(trial.get('fraction', 1.0))}: {trial['replica_hours']:.2f} replica-hours, "
            f"{100 * trial['sla_attainment']:.1f}% ({rate:.0f} replica-hours/min)  ",
            end="",
            file=sys.stderr,
            flush=True,
        )

    trials, complete = search(
        problem, space, opts.trials, out / "trials.jsonl", pool, opts.seed, progress
    )
    print(file=sys.stderr)
    if not trials:
        print("no trial finished", file=sys.stderr)
        return {"trials": 0}
    # The setting report.md chooses (else the cheapest tried) is the one drawn over time.
    chosen = cheapest(trials, target) or min(trials, key=lambda t: t["replica_hours"])
    series = problem.simulate(Setting(**chosen["setting"])).replica_series
    arrivals = [r.arrival_s for r in trace]
    searched = [k for k, v in space.values.items() if len(v) > 1]
    summary = write(out, trials, target, title, complete, searched, series, arrivals)
    print((out / "report.md").read_text())
    if summary["chosen"] is not None:
        print((out / "tuned.yaml").read_text())
    return {
        "trials": len(trials),
        "complete": complete,
        "target": {"slo": asdict(target.slo), "attainment": target.attainment}
        | {"percentiles": target.percentiles},
        "chosen": summary["chosen"],
        "front": summary["front"],
        "binding": summary["binding"],
        "wall_s": time.perf_counter() - started,
        "replica_hours_simulated": sum(t["replica_hours"] for t in trials),
    }


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _write_models(out: Path, results: dict[str | None, dict[str, Any]]) -> None:
    """tuned.yaml of a multi-model trace: deploy.yaml's `models:`, an entry per model whose
    search met the target (each model's report under its own folder)."""
    entries = []
    for who, result in results.items():
        if result.get("chosen") is None:
            continue
        setting = Setting(**result["chosen"]["setting"]).deploy_args()
        entries.append({"model": who, "served_model_name": who} | setting)
    missed = [str(who) for who, result in results.items() if result.get("chosen") is None]
    header = "# python -m cluster.tune: each model's cheapest setting meeting the target\n"
    header += "# (simulated; `model`: put each one's checkpoint there)\n"
    if missed:
        header += f"# no setting met the target for: {', '.join(missed)} (see their report.md)\n"
    body = yaml.safe_dump({"models": entries}, sort_keys=False, default_flow_style=False)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuned.yaml").write_text(header + body)
    print(header + body)
