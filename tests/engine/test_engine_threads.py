"""The engine's threads default to every core the process may run on (CPU), whatever OpenMP
count the process was started with (Ray sets it from a replica's fractional num_cpus)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def _threads(num_threads: str) -> list[int]:
    code = (
        "import torch; from engine.runner.engine_threads import set_engine_threads; "
        f"before = torch.get_num_threads(); chosen = set_engine_threads({num_threads}, 'cpu'); "
        "print(before, chosen, torch.get_num_threads())"
    )
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # as Ray sets it for num_cpus < 1
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return [int(x) for x in proc.stdout.split()]


def test_null_means_every_core_the_process_may_run_on():
    cores = len(os.sched_getaffinity(0))
    assert _threads("None") == [1, cores, cores]


def test_a_configured_count_wins():
    assert _threads("3") == [1, 3, 3]
