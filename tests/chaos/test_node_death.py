"""Chaos beyond one machine: on a 3-node Ray cluster (tests/chaos/multinode.py: a head with
the ingress and Serve's proxy, one engine replica on each of two worker nodes, the control
plane on the workers), the node of one engine replica (of two tensor-parallel ranks, each in
a bundle of the replica's placement group on the replica's node), or of the cluster
controller, removed while 16 greedy requests run loses none of them: all complete with an
undisturbed run's texts, Serve brings the replica back on the surviving node, every KV block
ends free, and /metrics and /v1/cluster answer again."""

from __future__ import annotations

import sys

import pytest

from tests.chaos.conftest import run_json
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(420)


# `tp` is the `engine` scenario with replicas of two tensor-parallel ranks (plain replicas
# die in `control`, whose victim node holds one too).
@pytest.mark.parametrize("scenario", ["tp", "control"])
def test_a_dead_node_loses_no_accepted_request(scenario):
    result = run_json([sys.executable, "-m", "tests.chaos.multinode", scenario], REPO, 400)
    assert result["placement"] == ["0", "1"], result  # one engine replica per worker node
    assert result["completed"] == 16 and result["equal"], result
    assert result["replicas_after"] == 2 and result["on_survivor"] == 2, result
    assert result["blocks_free"], result
    # Tensor-parallel replicas: each rank in its replica's placement group, on its node.
    ranks = 2 if scenario == "tp" else 0
    assert result["ranks_with_leader"] == [True] * ranks, result
    assert result["ranks_with_leader_after"] == [True] * ranks, result
    assert result["metrics_after_s"] is not None and result["cluster_after_s"] is not None, result
