"""run_json, which runs every chaos harness: one past its time gets to clean up."""

from __future__ import annotations

import sys

import pytest

from tests.chaos.conftest import run_json

HARNESS = """
import json, sys, time
print(json.dumps({"started": True}), flush=True)
try:
    time.sleep(float(sys.argv[1]))
    print(json.dumps({"slept": True}))
finally:
    open(sys.argv[2], "w").write("cluster down")
"""


def test_a_harness_past_its_time_runs_its_finally_before_it_is_reported(tmp_path):
    marker = tmp_path / "cleaned"
    command = [sys.executable, "-c", HARNESS, "60", str(marker)]
    with pytest.raises(AssertionError, match="timed out after 2 s"):
        run_json(command, tmp_path, 2)
    assert marker.read_text() == "cluster down"


def test_a_harness_in_time_gives_its_last_json_line(tmp_path):
    command = [sys.executable, "-c", HARNESS, "0", str(tmp_path / "cleaned")]
    assert run_json(command, tmp_path, 30) == {"slept": True}
