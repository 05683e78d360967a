"""The GPU headline stage (loadtests/headline), run end to end on the CPU at its quick sizes
(tiny model), so that it cannot rot between GPU runs: every step finishes, every figure the
plan names is a number, and the timeouts fit the budget."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from loadtests.headline.plan import BUDGET_S, FULL, QUICK, steps
from loadtests.workload import REPO

pytestmark = pytest.mark.timeout(240)


def test_the_steps_timeouts_add_up_to_at_most_the_budget():
    for sizes in (FULL, QUICK):
        assert sum(step.timeout_s for step in steps(sizes)) <= BUDGET_S <= 540


@pytest.mark.own_cluster
def test_the_quick_stage_reports_every_figure_as_a_number(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.headline", "--device", "cpu", "--dtype", "float32"]
        + ["--quick", "--out", str(out), "--work", str(tmp_path / "work")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "headline.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == report  # the JSON comes last
    for step in steps(QUICK):
        status = report["steps"][step.name]
        assert status["status"] == "ok", (step.name, (out / "headline.log").read_text()[-3000:])
        assert status["command"].startswith("python -m loadtests.headline")
        assert report["errors"][step.name] == {}
        figures = report["figures"][step.name]
        for key in step.keys:
            value = figures[key]
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
            assert math.isfinite(value) and value >= 0, (key, value)
    figures = report["figures"]
    assert figures["http"]["http_failed"] == 0
    for b in QUICK.decode_batches:
        assert 0 < figures["bf16"][f"roofline_frac_b{b}"] < 1.5  # a step costs what it reads
        assert figures["fp8_weights"][f"vs_bf16_b{b}"] > 0
    assert report["device_name"] and report["torch"]
