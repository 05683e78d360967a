"""`sweep --start-app deploy.yaml --ab batching`: the tool starts each variant itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(400)
@pytest.mark.own_cluster
def test_ab_sweep_starts_both_variants_and_compares_them(tiny_model, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtests.bench_serve",
            "sweep",
            "--start-app",
            "deploy.yaml",
            "--override",
            f"model={tiny_model}",
            "--override",
            "autoscaling=null",
            "--ab",
            "batching",
            "--concurrency",
            "4",
            "--level-duration",
            "3",
            "--workload",
            "uniform",
            "--prompt-len",
            "64",
            "--output-len",
            "24",
            "--no-progress",
            "--json",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert list(result["variants"]) == ["continuous", "static"]
    for v in result["variants"].values():
        (row,) = v["rows"]
        assert row["ok"] > 0 and row["errors"] == 0
        assert row["tokens_received"] == row["output_tokens"]
    assert "A/B against `continuous`" in (tmp_path / "report.md").read_text()
