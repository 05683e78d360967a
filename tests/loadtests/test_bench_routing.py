"""KV-aware routing against the first-tokens hash (issue 59, item 4) over HTTP, in one run:
20 three-turn conversations sharing a 96-token system prompt, two tiny engine replicas per
app, each with room in its cache for the histories of about half of the conversations
(loadtests/bench_routing.py; own Ray instance, subprocess). Routing by the blocks each
replica holds spreads the conversations and finds more of their prompts cached than the
hash, which sends most of them to one replica's cache. (TTFT is the benchmark's to print,
not a test's.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(400)
@pytest.mark.own_cluster
def test_kv_aware_routing_finds_more_of_the_prompts_cached(tiny_model):
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_routing", "--model", tiny_model, "--rounds", "1"]
        + ["--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    result = json.loads(proc.stdout.splitlines()[-1])
    hash_, kv = result["runs"]["hash"], result["runs"]["kv_aware"]
    # Every turn of every conversation answered, and looked up in the caches.
    assert hash_["requests"] == kv["requests"] == 20 * 3, result
    assert kv["prompt_tokens"] >= 20 * (160 + 288 + 416), result  # turns 1-3
    assert kv["busiest_replica_share"] < hash_["busiest_replica_share"], result
    assert kv["prefix_hit_rate"] > hash_["prefix_hit_rate"] + 0.1, result
