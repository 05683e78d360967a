"""bench_sim routing and migration: every routing rule's goodput on the same conversations,
and a day's scale-downs with and without moving the sequences (small settings here)."""

from __future__ import annotations

from loadtests.bench_sim.migration import describe as describe_migration
from loadtests.bench_sim.migration import run_migration
from loadtests.bench_sim.routing import describe, run_routing


def test_routing_compares_every_rule_on_the_same_conversations():
    result = run_routing(gpus=2, model="Llama-2-13B", gpu="A100-40GB", quick=True)
    (row,) = result["rows"]
    assert set(row["goodput_conversations_s"]) == {"least-loaded", "hash-64", "kv-aware"}
    assert all(rate > 0 for rate in row["goodput_conversations_s"].values()), row
    # (Which rule finds more is tests/cluster/test_prefix_routing_sim.py's: at this small
    # fleet's goodput its caches of 12k tokens hold little whatever the rule.)
    assert all(0 < hit < 1 for hit in row["prefix_hit_rate"].values()), row
    assert row["at_conversations_s"] == row["goodput_conversations_s"]["least-loaded"]
    assert "| ttft-1s | kv-aware |" in describe(result)


def test_migration_removes_replicas_without_draining():
    result = run_migration(duration_s=300.0)
    for row in result["rows"]:
        drain, migrate = row["drain"], row["migrate"]
        assert drain["moved"] == 0 and migrate["draining_replica_s"] == 0, row
        if migrate["scale_downs"]:
            assert migrate["moved"] > 0 and drain["draining_replica_s"] > 0, row
    assert "| long-output | migrate |" in describe_migration(result)
