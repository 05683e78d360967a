"""Fit the cost model's constants to the real torch engine on this machine.

    python -m loadtests.calibrate [--model small] [--num-requests 40] [--repeats 5] [--out F.json]

Runs the real engine on a seeded offline trace, times every step (the whole `engine.step()`,
so scheduling and detokenization land in the fitted overheads), then fits
    t = step_overhead_s + per_seq_overhead_s x requests + max(F / (P x fe), B / (W x be))
with P, W this machine's measured peak GEMM FLOP/s and read bandwidth: a grid over the two
efficiencies (fe, be) with least squares for the two overheads at each point. Then it replays
a second seeded trace in the simulator with the fitted constants and prints predicted vs
measured wall time.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.sim_config import SimConfig
from cluster.simulator import Simulator
from cluster.workload import LengthDist, SimRequest, make_workload
from engine.core.outputs import SchedulerOutput
from engine.runner.cost_model import NO_LOSS, CostParams, GpuSpec, ModelSpec, step_cost
from engine.runner.recording import RecordingRunner
from loadtests.peaks import measure_device, timed
from loadtests.workload import resolve_model


@dataclass(frozen=True)
class StepSample:
    compute_s: float  # F / P at 100% efficiency
    memory_s: float  # B / W at 100% efficiency
    num_seqs: int
    seconds: float  # measured


def run_real(
    engine_config, traces: list[list[SimRequest]], repeats: int = 3
) -> tuple[list[tuple[list[SchedulerOutput], list[float]]], int]:
    """For each trace, its step outputs and per-step wall seconds on a real engine, and the KV
    block count.

    Each trace runs `repeats` times on one warm engine, the traces taking turns so that a slow
    spell of this noisy machine hits all of them alike. An offline trace makes the same steps
    every time, so each step's time is the fastest of its repeats."""
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from engine.runner.torch_runner import TorchModelRunner

    runner = RecordingRunner(TorchModelRunner(engine_config))
    engine = LLMEngine(engine_config, runner=runner)
    engine.add_request("warmup", [7] * 16, SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    results: list[tuple[list[SchedulerOutput], list[float]] | None] = [None] * len(traces)
    for rep in range(repeats):
        for k, trace in enumerate(traces):
            runner.outputs.clear()
            for r in trace:
                params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                engine.add_request(f"{r.request_id}#{k}#{rep}", [7] * r.prompt_len, params)
            times = []
            while engine.has_unfinished_requests():
                n = len(runner.outputs)
                t = timed(engine.step)
                if len(runner.outputs) > n:
                    times.append(t)
            previous = results[k]
            if previous is None:
                results[k] = (list(runner.outputs), times)
            else:
                assert len(times) == len(previous[1]), "an offline trace repeats its steps"
                best = [min(a, b) for a, b in zip(previous[1], times, strict=True)]
                results[k] = (previous[0], best)
    return [r for r in results if r is not None], runner.num_kv_blocks()


def samples_of(outputs, times, model: ModelSpec, device: GpuSpec) -> list[StepSample]:
    out = []
    for o, t in zip(outputs, times, strict=True):
        raw = step_cost(o, model, device, NO_LOSS)
        flops_s = raw.flops / device.peak_flops
        bytes_s = raw.bytes / device.mem_bw
        out.append(StepSample(flops_s, bytes_s, len(o.scheduled), t))
    return out


def fit(samples: list[StepSample]) -> tuple[CostParams, float]:
    """Least-squares fit; returns the params and the relative error of the summed time."""
    best: tuple[float, CostParams] | None = None
    # Efficiencies from 0.01 to 2 on a log grid (small GEMMs are far from peak; CPU caches can
    # beat the streaming bandwidth W).
    grid = [0.01 * 1.06**i for i in range(92)]
    n = len(samples)
    sum_n = sum(s.num_seqs for s in samples)
    sum_nn = sum(s.num_seqs**2 for s in samples)
    det = n * sum_nn - sum_n**2
    for fe in grid:
        for be in grid:
            core = [max(s.compute_s / fe, s.memory_s / be) for s in samples]
            resid = [s.seconds - c for s, c in zip(samples, core, strict=True)]
            # Linear least squares of resid ~ o + k * num_seqs, both >= 0.
            sr = sum(resid)
            snr = sum(s.num_seqs * r for s, r in zip(samples, resid, strict=True))
            k = max((n * snr - sum_n * sr) / det, 0.0) if det > 0 else 0.0
            o = max((sr - k * sum_n) / n, 0.0)
            err = sum((r - o - k * s.num_seqs) ** 2 for s, r in zip(samples, resid, strict=True))
            if best is None or err < best[0]:
                best = (err, CostParams(fe, be, o, k))
    assert best is not None
    params = best[1]
    predicted = sum(
        params.step_overhead_s
        + params.per_seq_overhead_s * s.num_seqs
        + max(s.compute_s / params.flops_efficiency, s.memory_s / params.bw_efficiency)
        for s in samples
    )
    measured = sum(s.seconds for s in samples)
    return params, predicted / measured - 1


def predict_wall(
    model: ModelSpec,
    device: GpuSpec,
    params: CostParams,
    num_blocks: int,
    block_size: int,
    engine_config,
    trace: list[SimRequest],
) -> float:
    config = SimConfig(
        model=model, gpu=device, cost=params, scheduler=engine_config.scheduler
    ).with_cache(num_blocks=num_blocks, block_size=block_size)
    return Simulator(config).run(trace).duration_s


def calibrate(
    model_dir: str, num_requests: int, threads: int | None, seed: int = 0, repeats: int = 5
) -> dict:
    """`repeats`: runs of each trace, each step timed by its fastest run (more of them make
    the fit steadier on a busy host)."""
    from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig

    kv_bytes = 512 << 20
    engine_config = EngineConfig(
        model=model_dir,
        num_threads=threads,
        # No prefix caching: the traces' prompts are all alike, and the fit is of compute.
        cache=CacheConfig(block_size=16, kv_cache_bytes=kv_bytes, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024),
    )
    model = ModelSpec.from_hf_config(model_dir, dtype_bytes=4)
    device = measure_device(kv_bytes)
    lengths = dict(prompt=LengthDist("uniform", 16, 400), output=LengthDist("uniform", 8, 160))
    fit_trace = make_workload(num_requests, arrival="offline", seed=seed, **lengths)
    check_trace = make_workload(num_requests, arrival="offline", seed=seed + 1, **lengths)
    runs, num_blocks = run_real(engine_config, [fit_trace, check_trace], repeats)
    (outputs, times), (_, check_times) = runs
    params, fit_err = fit(samples_of(outputs, times, model, device))
    measured = sum(check_times)
    predicted = predict_wall(model, device, params, num_blocks, 16, engine_config, check_trace)
    return {
        "model": model_dir,
        "device": asdict(device),
        "params": asdict(params),
        "fit_sum_error": fit_err,
        "check_measured_s": measured,
        "check_predicted_s": predicted,
        "check_error": predicted / measured - 1,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="tiny | small | a checkpoint dir")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each trace")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    opts = parser.parse_args(argv)
    result = calibrate(
        resolve_model(opts.model), opts.num_requests, opts.threads, repeats=opts.repeats
    )
    text = json.dumps(result, indent=2)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(text + "\n")
    print(text)
    return result
