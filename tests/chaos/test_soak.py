"""Sixty-five seconds of the soak (loadtests/soak/cli.py) on a Ray of its own: mixed load
(streams, whole completions, streamed chats, aborts, clients that leave, bad bodies, bursts of
64 streams at 30 and 60 s) with one engine replica killed at 45 s. Nothing valid is lost,
wrong or hung, every bad body is refused naming its field, and every KV block is free at the
end."""

from __future__ import annotations

import json
import sys

import pytest

from tests.chaos.conftest import run_json
from tests.conftest import REPO

pytestmark = [pytest.mark.timeout(480), pytest.mark.own_cluster]


def test_a_soak_with_a_kill_loses_nothing_and_frees_every_block(tmp_path):
    command = [
        sys.executable,
        "-m",
        "loadtests.soak",
        "--duration",
        "65",
        "--kill-every",
        "45",
    ]
    command += ["--burst-every", "30", "--warmup", "20", "--sample-every", "5", "--json"]
    command += ["--out", str(tmp_path)]
    result = run_json(command, REPO, 460)
    assert (result["lost"], result["hung"], result["wrong"]) == (0, 0, 0), result["failures"]
    kinds = result["by_kind"]
    assert set(kinds) == {"stream", "whole", "chat", "abort", "disconnect", "bad", "burst"}, kinds
    assert kinds["burst"].get("ok") == 64 * 2, kinds["burst"]  # two bursts, every stream whole
    assert kinds["bad"].get("refused", 0) == sum(kinds["bad"].values()), kinds["bad"]
    assert result["requests"] > 300, result["requests"]
    assert [k.get("pid") is not None for k in result["kills"]] == [True], result["kills"]
    assert result["blocks_free"], result["engine_replicas_at_end"]
    # Memory was sampled for every process of the soak's cluster, the engine replicas too.
    roles = {row["role"] for row in result["rss_growth"]}
    assert "EngineServer" in json.loads((tmp_path / "rss.json").read_text()), roles
    assert (tmp_path / "rss.png").stat().st_size > 0
