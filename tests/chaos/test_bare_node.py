"""Deploying to a cluster whose worker nodes lack our package (tests/chaos/bare_node.py): the
app goes on through deploy.yaml's `runtime_env.working_dir` (the zip of
serve_app.deploy.code_bundle), submitted by `serve run`, and its replicas serve from a node whose
Python cannot import it otherwise."""

from __future__ import annotations

import sys

import pytest

from tests.chaos.conftest import run_json
from tests.conftest import REPO, tiny_model_dir

pytestmark = [pytest.mark.timeout(600), pytest.mark.own_cluster]


def test_a_node_without_our_package_serves_the_app_through_runtime_env(tmp_path):
    script = REPO / "tests" / "chaos" / "bare_node.py"
    # Run from outside the repository: a driver's sys.path would otherwise reach the workers.
    command = [sys.executable, str(script), tiny_model_dir(), str(tmp_path)]
    result = run_json(command, tmp_path, 580)
    # The node's Python, and a Ray worker there, cannot import the app by themselves.
    assert not result["bare_imports_ours"] and not result["bare_worker_imports_ours"], result
    assert result["serve_run_rc"] == 0 and result["answered"] and result["tokens"] == 8, result
    assert result["engine_on_bare"] and result["ingress_on_bare"], result
