"""Chaos beyond one machine: on a 3-node Ray cluster (tests/chaos/multinode.py: a head with
the ingress and Serve's proxy, one engine replica of two tensor-parallel ranks on each of two
worker nodes, each rank in a bundle of its replica's placement group, the control plane on
the workers), the node of the cluster controller and of one engine replica removed while 16
greedy requests run loses none of them: all complete with an undisturbed run's texts, Serve
brings the replica back on the surviving node, its ranks again on its node, every KV block
ends free, and /metrics and /v1/cluster answer again. (Plain replicas lose their node in
tests/chaos/test_netns_node.py.) Then the tuner's trials run as Ray tasks with two fresh
worker nodes joined, one of them lost mid-search after it landed a trial: the trial it was
running runs again elsewhere, and the search's trials equal the same search's run in one
process. (Ray spreads the trials over every node with a CPU free, the head and the engines'
surviving node among them, so which other node ran one is not asserted.)"""

from __future__ import annotations

import sys

import pytest

from tests.chaos.conftest import run_json
from tests.conftest import REPO

pytestmark = [pytest.mark.timeout(580), pytest.mark.own_cluster]


def test_a_dead_node_loses_no_accepted_request():
    result = run_json([sys.executable, "-m", "tests.chaos.multinode", "control+tp+tune"], REPO, 560)
    assert result["placement"] == ["0", "1"], result  # one engine replica per worker node
    assert result["completed"] == 16 and result["equal"], result
    assert result["replicas_after"] == 2 and result["on_survivor"] == 2, result
    assert result["blocks_free"], result
    assert result["ranks_with_leader"] == [True] * 2, result
    assert result["ranks_with_leader_after"] == [True] * 2, result
    assert result["metrics_after_s"] is not None and result["cluster_after_s"] is not None, result
    tune = result["tune"]
    assert tune["complete"] and tune["trials"] == 7 and tune["equal"] and tune["cli_equal"], tune
    assert tune["victim_ran"] >= 1 and tune["rerun"] >= 1 and tune["nodes"] >= 2, tune
