"""The controller's rules without Ray: per-replica policies, the cluster SLA rule, expiry."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from cluster.batching import (
    Bounds,
    DecodeWindow,
    SlaConfig,
    SlaPolicy,
    make_policy,
)
from cluster.control import ClusterControl, ReplicaStats, weighted_load
from tests.cluster.test_batching import decode_step, stats

SLA = SlaConfig(target_s=0.05, eps_s=0.005, alpha=4, delta=4, max_step=0, bounds=Bounds(1, 64))


def report(rid: str, decode: DecodeWindow | None = None, **sched) -> ReplicaStats:
    return ReplicaStats(
        rid, stats(**sched), num_streams=sched.get("num_running", 0), capacity=96, decode=decode
    )


def test_decode_window_between_snapshots():
    a = stats(decode_steps_total=10, decode_step_seconds_total=1.0, decode_step_seqs_total=100)
    b = replace(a, decode_steps_total=14, decode_step_seconds_total=1.2, decode_step_seqs_total=180)
    w = DecodeWindow.between(a, b)
    assert w is not None and w.num_steps == 4
    assert abs(w.mean_step_s - 0.05) < 1e-12 and w.mean_batch == 20
    assert DecodeWindow.between(b, b) is None  # no decode-only step in between
    assert DecodeWindow.between(None, a).num_steps == 10


def test_window_form_matches_per_step_form():
    """The controller's periodic call and the engine's per-step call do the same arithmetic."""
    per_step, periodic = SlaPolicy(replace(SLA, window=1), 32), SlaPolicy(SLA, 32)
    for i, (lat, batch) in enumerate([(0.08, 32), (0.02, 16), (0.05, 26), (0.09, 26)]):
        a = per_step.limits(decode_step(i + 1, lat, batch, decoding=4)).max_num_seqs
        window = DecodeWindow(1, lat, batch)
        b = periodic.limits_from_window(stats(num_decoding=4), window).max_num_seqs
        assert a == b


def test_one_policy_per_replica_and_limits_follow_each_replica():
    control = ClusterControl(partial(make_policy, "sla", 32, None, SLA))
    slow = DecodeWindow(10, 0.08, 32)
    fast = DecodeWindow(10, 0.02, 32)
    d_slow = control.report(report("a", slow, num_decoding=2), now=0.0)
    d_fast = control.report(report("b", fast, num_decoding=2), now=0.0)
    # Slow: interval [1, 32] -> 16. Fast: interval [28, 36] -> 32.
    assert d_slow.limits.max_num_seqs == 16
    assert d_fast.limits.max_num_seqs == 48
    assert set(control.replicas) == {"a", "b"}
    # The first report of a replica without decode steps keeps its current limit.
    d_new = control.report(report("c", None, max_num_seqs=32), now=0.0)
    assert d_new.limits.max_num_seqs == 32 and not d_new.throttled


def test_cluster_sla_rule_throttles_the_slow_replica_and_shifts_routing():
    control = ClusterControl(partial(make_policy, "combined", 32, None, SLA))
    control.report(report("fast", DecodeWindow(10, 0.02, 32)), now=0.0)
    d = control.report(report("slow", DecodeWindow(10, 0.08, 32)), now=0.0)
    assert d.throttled and "over the 50 ms target" in d.reason
    assert d.routing_weight == 16 / 32
    view = {r["replica_id"]: r for r in control.view(now=0.0)["replicas"]}
    assert not view["fast"]["throttled"] and view["fast"]["routing_weight"] == 1.0
    assert view["slow"]["throttled"]
    # The router ranks the throttled replica behind the fast one at equal outstanding load,
    # and sends it new work only once the other holds twice as much.
    assert weighted_load(4, d.routing_weight) > weighted_load(4, 1.0)
    assert weighted_load(4, d.routing_weight) <= weighted_load(9, 1.0)
    # Back under target: the throttle lifts.
    d = control.report(report("slow", DecodeWindow(10, 0.03, 16)), now=1.0)
    assert not d.throttled and d.routing_weight == 1.0


def test_policies_without_sla_never_throttle():
    control = ClusterControl(partial(make_policy, "memory_aware", 32, None, None))
    d = control.report(report("a", DecodeWindow(10, 9.0, 32), num_running=4), now=0.0)
    assert not d.throttled and d.routing_weight == 1.0


def test_silent_replicas_drop_out_and_a_fresh_controller_rebuilds_from_reports():
    control = ClusterControl(partial(make_policy, "static", 32, None, None), stale_after_s=5.0)
    control.report(report("a"), now=0.0)
    control.report(report("b"), now=3.0)
    assert control.view(now=4.0)["num_replicas"] == 2
    view = control.view(now=6.0)  # a silent for 6 s
    assert [r["replica_id"] for r in view["replicas"]] == ["b"] and view["expired_total"] == 1
    restarted = ClusterControl(partial(make_policy, "static", 32, None, None))
    restarted.report(report("b", num_running=3), now=7.0)
    assert restarted.view(now=7.0)["replicas"][0]["running"] == 3


def test_a_fresh_controller_goes_on_from_each_replicas_current_limit():
    """A restarted controller (or one that expired a replica) keeps a raised limit; it does
    not drop the replica back to the configured start value."""
    sla = partial(make_policy, "sla", 32, None, SLA)
    first = ClusterControl(sla)
    raised = first.report(report("a", DecodeWindow(10, 0.02, 32), num_decoding=2), now=0.0)
    assert raised.limits.max_num_seqs == 48
    restarted = ClusterControl(sla)
    d = restarted.report(report("a", None, max_num_seqs=48), now=1.0)
    assert d.limits.max_num_seqs == 48
    # Still headroom: the search goes on upward from 48 (not from 32).
    d = restarted.report(report("a", DecodeWindow(10, 0.02, 48), max_num_seqs=48), now=2.0)
    assert d.limits.max_num_seqs > 48
    # A static policy stays at its configured value whatever the replica reports.
    static = ClusterControl(partial(make_policy, "static", 32, None, None))
    assert static.report(report("b", None, max_num_seqs=48), now=0.0).limits.max_num_seqs == 32


def test_retuned_settings_reach_every_replica_at_its_next_report():
    """Settings applied to a running app: a new policy (a fresh one per replica, from the new
    start value) and token budget, with no replica's report lost."""
    control = ClusterControl(partial(make_policy, "sla", 32, None, SLA))
    for rid in ("a", "b"):
        control.report(report(rid, DecodeWindow(10, 0.02, 32), num_decoding=2), now=0.0)
    control.retune(partial(make_policy, "static", 12), max_num_batched_tokens=512)
    for rid in ("a", "b"):
        decision = control.report(report(rid, DecodeWindow(10, 0.02, 32)), now=1.0)
        assert (decision.limits.max_num_seqs, decision.limits.max_num_batched_tokens) == (12, 512)
        assert control.replicas[rid].num_reports == 2
    # A replica that joins later gets them too.
    assert control.report(report("c"), now=1.0).limits.max_num_seqs == 12
