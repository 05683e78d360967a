"""Check the calibrated simulator against the real engine on traces with arrivals in time.

    python -m loadtests.calibrate.replay [--model small] [--num-requests 60] [--loads 0.5,0.9]
        [--calibration reports/calibration-small.json] [--out reports/calibration-replay.json]

Two seeded Poisson traces (rates at `--loads` of the engine's offline throughput in requests/s,
as the calibrated simulator predicts it) are replayed on the real torch engine, requests
handed over at their arrival times on the wall clock (at a step boundary, as a server does),
and in the simulator with the calibration's device and constants and the engine's own KV
block count and scheduler knobs. Reports throughput and TTFT / ITL p50 and p99 of each, and
each figure's error (simulated / measured - 1). Run it alone: the real side is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cluster.metrics import percentile
from cluster.request_records import RequestRecord
from cluster.sim_config import SimConfig
from cluster.simulator import Simulator
from cluster.workload import LengthDist, SimRequest, make_workload
from engine.runner.cost_model import CostParams, GpuSpec, ModelSpec
from loadtests.workload import resolve_model

LENGTHS = dict(prompt=LengthDist("uniform", 16, 400), output=LengthDist("uniform", 8, 160))
FIGURES = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")


def engine_config(model_dir: str, threads: int | None):
    """The engine calibrate.py fits (the same cache and scheduler)."""
    from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=model_dir,
        num_threads=threads,
        cache=CacheConfig(block_size=16, kv_cache_bytes=512 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024),
    )


def figures(records: dict[str, RequestRecord]) -> dict[str, float]:
    done = [r for r in records.values() if r.finish_s is not None]
    span = max(r.finish_s for r in done) - min(r.arrival_s for r in done)  # type: ignore[type-var]
    return {
        "output_tok_s": sum(r.num_output for r in done) / span,
        "ttft_p50_s": percentile([r.ttft for r in done], 50),
        "ttft_p99_s": percentile([r.ttft for r in done], 99),
        "itl_p50_s": percentile([r.itl for r in done], 50),
        "itl_p99_s": percentile([r.itl for r in done], 99),
    }


def replay_real(engine, trace: list[SimRequest]) -> dict[str, RequestRecord]:
    """Each request handed to the engine once its arrival time has passed on the wall clock."""
    from engine.core.sampling_params import SamplingParams

    records = {r.request_id: RequestRecord(r.arrival_s, r.prompt_len, r.output_len) for r in trace}
    pending = list(trace)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(r.request_id, [7] * r.prompt_len, params)
        if not engine.has_unfinished_requests():
            time.sleep(max(pending[0].arrival_s - now, 0.0))
            continue
        outputs = engine.step()
        t = time.perf_counter() - start
        for out in outputs:
            rec = records[out.request_id]
            if out.new_token_ids and rec.first_token_s is None:
                rec.first_token_s = t
            rec.num_output = out.num_output_tokens
            if out.finished:
                rec.finish_s = t
    return records


def run(model: str, calibration: dict, num_requests: int, loads: list[float], threads) -> dict:
    from engine.llm_engine import LLMEngine

    config = engine_config(resolve_model(model), threads)
    engine = LLMEngine(config)
    spec = ModelSpec.from_hf_config(config.model, dtype_bytes=4)
    device, params = GpuSpec(**calibration["device"]), CostParams(**calibration["params"])
    num_blocks = engine.stats().num_total_blocks
    sim = SimConfig(spec, device, cost=params, scheduler=config.scheduler).with_cache(
        num_blocks=num_blocks, block_size=config.cache.block_size
    )
    offline = make_workload(num_requests, arrival="offline", seed=9, **LENGTHS)
    full_rps = num_requests / Simulator(sim).run(offline).duration_s
    replay_real(engine, make_workload(8, 50.0, seed=8, **LENGTHS))  # warm-up
    rows = []
    for k, load in enumerate(loads):
        trace = make_workload(num_requests, load * full_rps, seed=10 + k, **LENGTHS)
        measured = figures(replay_real(engine, trace))
        simulated = figures(Simulator(sim).run(trace).records)
        errors = {f: simulated[f] / measured[f] - 1 for f in FIGURES}
        rows.append(
            {"load": load, "rate_rps": load * full_rps, "measured": measured}
            | {"simulated": simulated, "error": errors}
        )
        worst = max(abs(e) for e in errors.values())
        print(f"load {load}: worst error {100 * worst:.1f}%", file=sys.stderr)
    return {"model": config.model, "num_kv_blocks": num_blocks, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--calibration", default="reports/calibration-small.json")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--loads", default="0.5,0.9")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    opts = parser.parse_args(argv)
    calibration = json.loads(Path(opts.calibration).read_text())
    loads = [float(x) for x in opts.loads.split(",")]
    result = run(opts.model, calibration, opts.num_requests, loads, opts.threads)
    text = json.dumps(result, indent=2)
    if opts.out:
        Path(opts.out).write_text(text + "\n")
    for row in result["rows"]:
        print(f"load {row['load']} ({row['rate_rps']:.2f} req/s):")
        for f in FIGURES:
            m, s, e = row["measured"][f], row["simulated"][f], row["error"][f]
            print(f"  {f:13} measured {m:9.4f}  simulated {s:9.4f}  error {100 * e:+6.1f}%")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
