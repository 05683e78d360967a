"""The tuner's trials as Ray tasks on the 3-node cluster of tests/chaos/multinode.py (scenario
`+tune`): two fresh worker nodes join, a search runs through `RayPool` while one of them is
lost after it landed a trial, and `python -m cluster.tune --ray ADDRESS` runs the same search
from a driver of its own (our code shipped to the workers); both come back with the trials
of the same search run in this process (same seed and budget)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil

from cluster.request_records import Slo
from cluster.trace_file import save_trace
from cluster.tune.problem import Problem
from cluster.tune.ray_pool import RayPool
from cluster.tune.search import search
from cluster.tune.space import DEFAULT_SPACE, Space
from cluster.workload import make_workload
from engine.runner.cost_model import GPUS, MODELS, CostParams

# The CLI's grid with these knobs set (`--set`): 36 settings, so a budget of 10 whole-trace
# runs goes through successive halving and the front's neighbours.
SET = {"upscale_delay_s": [10.0], "downscale_delay_s": [60.0], "max_replicas": [2, 4]}
SPACE = DEFAULT_SPACE | SET
BUDGET, SEED = 10, 7


def _figures(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trials without their wall time, in the order of their settings."""
    kept = [{k: v for k, v in t.items() if k != "wall_s"} for t in trials]
    return sorted(kept, key=lambda t: json.dumps(t["setting"], sort_keys=True))


def _cli(address: str, trace: Path, out: Path) -> list[dict[str, Any]]:
    """The whole-trace trials of `python -m cluster.tune --ray address` on `trace`."""
    command = [sys.executable, "-m", "cluster.tune", "--trace", str(trace), "--ray", address]
    command += ["--slo", "ttft=2", "--slo", "itl=0.1", "--trials", str(BUDGET)]
    command += ["--seed", str(SEED), "--out", str(out)]
    command += [f"--set={k}={','.join(map(str, v))}" for k, v in SET.items()]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]


def _started_by(node) -> list[psutil.Process]:
    """The processes the node's raylet started (its workers among them)."""
    return psutil.Process(node.all_processes["raylet"][0].process.pid).children(recursive=True)


def _running_a_trial(node) -> bool:
    """Whether a worker of the node runs a trial now (a Ray worker's title names its task)."""
    for process in _started_by(node):
        with contextlib.suppress(psutil.Error):
            if any("_trial" in part for part in process.cmdline()):
                return True
    return False


def _signal_all(node, sig: int) -> None:
    for process in _started_by(node):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)


def _lose(cluster, node) -> None:
    """The node gone as a machine goes: its raylet and every process it started (a worker
    cut off from its raylet would otherwise finish the trial it runs)."""
    started = _started_by(node)
    cluster.remove_node(node, allow_graceful=False)
    for process in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


class _Loser(threading.Thread):
    """Loses `victim` once it has landed a trial and while it runs another, so that one is
    lost with it. It looks every POLL_S, not only as trials land: a victim's trials could all
    end between two landings elsewhere, and then none was lost. The node's processes are
    stopped while it looks, so the trial it runs cannot end meanwhile."""

    POLL_S = 0.02

    def __init__(self, cluster, victim, pool: RayPool) -> None:
        super().__init__(daemon=True)
        self.cluster, self.victim, self.pool = cluster, victim, pool
        self.stop = threading.Event()
        self.removed_after: int | None = None  # the trials the victim had landed

    def run(self) -> None:
        while not self.stop.wait(self.POLL_S):
            landed = self.pool.nodes[self.victim.node_id]
            if not landed or not _running_a_trial(self.victim):
                continue
            _signal_all(self.victim, signal.SIGSTOP)
            if _running_a_trial(self.victim):
                _lose(self.cluster, self.victim)
                self.removed_after = landed
                return
            _signal_all(self.victim, signal.SIGCONT)


def tune_across(cluster, out: Path) -> dict[str, Any]:
    trace = make_workload(3000, 6.0, seed=5)
    save_trace(trace, out / "trace.jsonl")
    problem = Problem(
        trace, MODELS["Llama-2-7B"], GPUS["A100-80GB"], CostParams(), Slo(ttft_s=2.0, itl_s=0.1)
    )
    space = Space.of(SPACE)
    here, _ = search(problem, space, BUDGET, out / "here.jsonl", seed=SEED)
    fresh = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    victim, survivor = fresh
    with RayPool() as pool:
        loser = _Loser(cluster, victim, pool)
        loser.start()
        try:
            there, complete = search(problem, space, BUDGET, out / "there.jsonl", pool, SEED)
        finally:
            loser.stop.set()
            loser.join()
        ran = dict(pool.nodes)
        rerun = pool.rerun
    from_cli = _cli(cluster.address, out / "trace.jsonl", out / "cli")
    return {
        "cli_equal": _figures(from_cli) == _figures(here),
        "complete": complete,
        "trials": len(there),
        "equal": _figures(there) == _figures(here),
        "removed_after": loser.removed_after,
        "rerun": rerun,
        "victim_ran": ran.get(victim.node_id, 0),
        "survivor_ran": ran.get(survivor.node_id, 0),
        "nodes": len(ran),
    }
