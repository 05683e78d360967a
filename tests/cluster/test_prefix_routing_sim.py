"""KV-aware and hash routing in the cluster simulator (issue 59 item 5): conversations whose
turns extend one another (cluster/conversations.py), routed by the rules the app's router
applies (cluster/prefix_routing.py) over replicas with prefix caching."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.cluster_sim import ClusterSimConfig, ClusterSimulator
from cluster.conversations import make_conversations, prompt_tokens
from cluster.prefix_routing import PrefixRouting
from cluster.sim_config import SimConfig
from cluster.workload import SimRequest
from engine.runner.cost_model import GPUS, MODELS


def test_a_conversations_turns_extend_one_another_and_share_only_the_system_prompt():
    trace = make_conversations(30, 2.0, turns=4, system_len=64, max_prompt_len=2048, seed=3)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert all(r.prompt_len + r.output_len <= 2048 for r in trace)
    by_conversation: dict[int, list[SimRequest]] = {}
    for r in trace:
        by_conversation.setdefault(r.conversation, []).append(r)
    assert len(by_conversation) == 30
    for turns in by_conversation.values():
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later.arrival_s > earlier.arrival_s
            # The next prompt holds this one, its reply, and a new message.
            assert later.prompt_len > earlier.prompt_len + earlier.output_len
            shorter = prompt_tokens(earlier)
            assert prompt_tokens(later)[: len(shorter)] == shorter
    a, b = (prompt_tokens(turns[0]) for turns in list(by_conversation.values())[:2])
    assert a[:64] == b[:64] and all(x != y for x, y in zip(a[64:], b[64:], strict=False))
    # A request of its own shares no token with another.
    own = [prompt_tokens(SimRequest(f"r{i}", 0.0, 40, 8)) for i in range(2)]
    assert not set(own[0]) & set(own[1]) and not set(own[0]) & set(a)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    # Each replica's cache holds 24k tokens (1,500 blocks): not every conversation's history,
    # so where turns go decides what is found.
    config = SimConfig(MODELS["Llama-3.1-8B"], GPUS["H100-80GB"]).with_cache(
        enable_prefix_caching=True, num_blocks=1500
    )
    trace = make_conversations(60, 8.0, seed=1)
    out = {}
    for name, rule in {
        "least-loaded": None,
        "hash": PrefixRouting(),
        "kv-aware": PrefixRouting(kv_aware=True),
    }.items():
        sim = ClusterSimulator(ClusterSimConfig(config, initial_replicas=3, prefix_routing=rule))
        result = sim.run(trace)
        assert len(result.records) == len(trace)
        assert all(rec.finish_s is not None for rec in result.records.values())
        out[name] = result.summary()
    return out


def test_kv_aware_routing_finds_more_of_each_prompt_cached_than_the_hash_or_load(runs):
    hits = {name: s["prefix_hit_rate"] for name, s in runs.items()}
    # Every replica holds the system prompt soon, wherever turns go; only routing by the
    # blocks held follows each conversation to the replica holding its earlier turns (the
    # hash sends all to one replica, whose cache cannot hold them, until it is too busy).
    assert hits["kv-aware"] > hits["hash"] + 0.05, hits
    assert hits["kv-aware"] > hits["least-loaded"] + 0.05, hits
    # Less prefill: a shorter first token on the same trace.
    assert runs["kv-aware"]["ttft_p50_s"] < runs["least-loaded"]["ttft_p50_s"], runs


def test_without_prefix_caching_kv_aware_routing_is_least_loaded_routing():
    config = SimConfig(MODELS["Llama-3.1-8B"], GPUS["H100-80GB"])  # prefix caching off
    trace = make_conversations(10, 2.0, seed=2)
    kv_aware = PrefixRouting(kv_aware=True)
    setup = ClusterSimConfig(config, initial_replicas=2, prefix_routing=kv_aware)
    summary = ClusterSimulator(setup).run(trace).summary()
    assert "prefix_hit_rate" not in summary and summary["finished"] == len(trace)
    # No replica holds a block: the score is the load, and the choices are the same.
    assert ClusterSimulator(replace(setup, prefix_routing=None)).run(trace).summary() == summary
