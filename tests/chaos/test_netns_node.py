"""A worker node cut off from the network rather than killed (tests/chaos/netns_node.py: the
node in a network namespace of its own, its veth link set down while 16 greedy requests run):
every request completes with an undisturbed run's text, Serve brings the lost replica back on
the other worker, and every KV block ends free."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from tests.chaos.conftest import run_json
from tests.conftest import REPO

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.own_cluster,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root"
    ),
]


def test_a_node_cut_off_from_the_network_loses_no_request():
    result = run_json([sys.executable, "-m", "tests.chaos.netns_node"], REPO, 580)
    assert result["one_replica_per_worker"] and result["cut"], result
    assert result["completed"] == 16 and result["equal"] and result["resumed"] > 0, result
    assert result["replicas_after"] == 2 and result["blocks_free"], result
    assert result["cluster_after_s"] is not None, result
