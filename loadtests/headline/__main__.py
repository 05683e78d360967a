"""The GPU headline: every figure a GPU user asks first, in one call of at most BUDGET_S.

    python -m loadtests.headline --device cuda --dtype bfloat16 --out DIR
    python -m loadtests.headline --device cpu --dtype float32 --quick --out DIR   # the test

Steps (loadtests/headline/plan.py), each its own process with its own timeout (they add up
to the budget): the 8B-shaped checkpoint; bf16 decode against the HBM roofline, prefill
against the GEMM peak, a fixed workload and the GPU self-check; FP8 weights; FP8 KV cache;
ngram speculation; the Serve app over HTTP against the in-process engine. A step that fails
or times out leaves its figures null (those it finished stay); the rest still run. Writes
DIR/headline.json (also printed last) and headline.log (every step's output); each step's own
log and JSON go to --work (default DIR).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.headline.plan import BUDGET_S, FULL, QUICK, Sizes, Step, steps
from loadtests.workload import REPO

_SHM_NEEDED = 24e9  # the 8B-shaped checkpoint (16 GB) with room to spare


def checkpoint_dir(quick: bool) -> str:
    """Where the checkpoint lives: the tiny model, or the 8B-shaped one in memory (/dev/shm)
    where it fits, which serves every step's load faster than a disk."""
    if quick:
        return str(REPO / "models" / "tiny")
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > _SHM_NEEDED:
        return str(shm / "dynabatch-llama3-8b")
    return "/tmp/dynabatch-llama3-8b"


def command(step: Step, opts: argparse.Namespace, model: str, out: Path) -> list[str]:
    argv = [sys.executable, "-m", step.module]
    if step.module.endswith("engine_step"):
        argv += ["--variant", step.name]
    argv += ["--model", model, "--device", opts.device, "--dtype", opts.dtype]
    argv += ["--out", str(out / f"{step.name}.json")]
    return argv + (["--quick"] if opts.quick else [])


def run_step(argv: list[str], log: Path, limit_s: float) -> tuple[str, float]:
    """The step's process (and whatever it started) within `limit_s`: its status and wall."""
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(limit_s, 1.0))
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            status = "timeout"
        # Its children too (a step's Ray cluster), whether it ended or not.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return status, time.monotonic() - start


def _ratio(numerator: Any, denominator: Any) -> float | None:
    if isinstance(numerator, (int, float)) and isinstance(denominator, (int, float)):
        return numerator / denominator if denominator else None
    return None


def derived(figures: dict[str, dict[str, Any]], sizes: Sizes) -> None:
    """Each FP8 variant's decode speedup over bf16, batch by batch."""
    for variant in ("fp8_weights", "fp8_kv"):
        for b, key in zip(sizes.decode_batches, sizes.speedup_keys(), strict=True):
            step_ms = f"decode_ms_b{b}"
            figures[variant][key] = _ratio(figures["bf16"][step_ms], figures[variant][step_ms])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=None, help="default: the 8B-shaped checkpoint")
    parser.add_argument("--out", default="bench_out/headline", help="headline.json and .log")
    parser.add_argument("--work", default=None, help="each step's log and JSON (default: OUT)")
    parser.add_argument("--quick", action="store_true", help="tiny model, CPU-test sizes")
    parser.add_argument("--only", default=None, help="comma-separated step names")
    opts = parser.parse_args(argv)
    sizes = QUICK if opts.quick else FULL
    plan = steps(sizes)
    assert sum(s.timeout_s for s in plan) <= BUDGET_S, "the steps' timeouts pass the budget"
    if opts.only:
        plan = [s for s in plan if s.name in opts.only.split(",")]
    out = Path(opts.out)
    work = Path(opts.work or out)
    for folder in (out, work):
        folder.mkdir(parents=True, exist_ok=True)
    model = opts.model or checkpoint_dir(opts.quick)
    deadline = time.monotonic() + BUDGET_S
    report: dict[str, Any] = {"steps": {}, "figures": {}, "errors": {}}
    logs: list[str] = []
    for step in plan:
        argv_ = command(step, opts, model, work)
        limit = min(step.timeout_s, deadline - time.monotonic())
        print(f"== {step.name} (at most {limit:.0f} s): {shlex.join(argv_)}", flush=True)
        log = work / f"{step.name}.log"
        status, wall = run_step(argv_, log, limit)
        print(f"== {step.name}: {status} in {wall:.1f} s", flush=True)
        path = work / f"{step.name}.json"
        found = json.loads(path.read_text()) if path.exists() else {"figures": {}, "errors": {}}
        text = log.read_text(errors="replace")
        logs.append(f"===== {step.name}: {status}\n{text}")
        if status != "ok" or found["errors"]:
            print("\n".join(text.splitlines()[-25:]), flush=True)
        figures = {key: found["figures"].get(key) for key in step.keys}
        figures |= {k: v for k, v in found["figures"].items() if k not in figures}
        report["figures"][step.name] = figures
        report["errors"][step.name] = found["errors"]
        command_line = shlex.join(argv_).replace(sys.executable, "python")
        report["steps"][step.name] = {
            "command": command_line,
            "timeout_s": step.timeout_s,
            "wall_s": round(wall, 1),
            "status": status,
        }
    if {"bf16", "fp8_weights", "fp8_kv"} <= report["figures"].keys():
        derived(report["figures"], sizes)
    bf16 = report["figures"].get("bf16", {})
    report |= {
        "device": opts.device,
        "device_name": bf16.pop("device_name", None),
        "torch": bf16.pop("torch", None),
        "cuda": bf16.pop("cuda", None),
        "dtype": opts.dtype,
        "model": model,
        "quick": opts.quick,
        "budget_s": BUDGET_S,
        "sizes": sizes.__dict__,
    }
    (out / "headline.json").write_text(json.dumps(report, indent=1))
    (out / "headline.log").write_text("\n".join(logs))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
