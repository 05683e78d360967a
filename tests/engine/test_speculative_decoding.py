"""Speculative decoding changes no output: greedy and seeded sampling with drafts equal the
same engine without them, token for token and text for text, through chunked prefill,
preemption by recompute and swap, prefix-cache hits and failover resume; every block comes
back and the integrity check holds every step."""

from __future__ import annotations

import random

import pytest

from engine.core.errors import InvalidParam
from engine.core.fixed_proposers import ReplayProposer
from engine.core.request import Resume
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.conftest import build_engine
from tests.engine.test_oracle import check_against_oracle, oracle, scenario_engine

__all__ = ["oracle"]  # the module-scoped fixture, shared

# Adaptive drafting reads wall-clock step times; these tests fix k to see every draft.
FIXED_K = {"adaptive": False, "num_speculative_tokens": 4}


def repetitive_prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so prompt lookup finds drafts (some right, some not)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(4096) for _ in range(rng.randint(2, 6))]
        noise = [rng.randrange(4096) for _ in range(rng.randint(0, 20))]
        prompts.append(noise + phrase * rng.randint(2, 5))
    return prompts


def run(engine: LLMEngine, prompts, params, arrive_at=None) -> dict[str, tuple]:
    """Run every prompt (prompt i arriving at step arrive_at[i]); per request id its token
    ids, text, finish reason and reported output count. Checks integrity every step."""
    arrive_at = arrive_at or [0] * len(prompts)
    pending = sorted(range(len(prompts)), key=lambda i: arrive_at[i])
    got: dict[str, list] = {str(i): [[], "", None, 0] for i in range(len(prompts))}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrive_at[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params[i])
        for out in engine.step():
            entry = got[out.request_id]
            entry[0] += out.new_token_ids
            entry[1] += out.new_text
            entry[2], entry[3] = out.finish_reason, out.num_output_tokens
        engine.scheduler.check_integrity()
        step += 1
    kv = engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    return {rid: tuple(v) for rid, v in got.items()}


def greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]


def sampled(n: int, seed: int) -> list[SamplingParams]:
    """Seeded draws with filters, penalties on some, min_tokens on some."""
    rng = random.Random(seed)
    params = []
    for i in range(n):
        params.append(
            SamplingParams(
                temperature=rng.choice([0.6, 1.0]),
                top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([0, 50]),
                seed=1000 + i,
                presence_penalty=0.4 if i % 3 == 0 else 0.0,
                repetition_penalty=1.2 if i % 4 == 1 else 1.0,
                max_tokens=rng.randint(8, 24),
                min_tokens=6 if i % 5 == 2 else 0,
            )
        )
    return params


SPEC_SCENARIOS = ["roomy", "chunked-prefill", "preemption", "chunked+preemption"]


def spec_scenario_engine(model: str, scenario: str, **engine_args) -> LLMEngine:
    """test_oracle's scenarios, and "swap": a cache small enough that swap preemption runs."""
    if scenario == "swap":
        return build_engine(
            model, 4, 26, num_host_blocks=200, max_num_seqs=8, max_num_batched_tokens=24,
            preemption_mode="swap", **engine_args,
        )  # fmt: skip
    return scenario_engine(model, scenario, **engine_args)


@pytest.mark.parametrize("scenario", SPEC_SCENARIOS)
def test_greedy_ngram_speculation_changes_no_token_and_matches_hf(tiny_model, oracle, scenario):
    rng = random.Random(3)
    prompts = repetitive_prompts(3, 12)
    max_tokens = [rng.randint(4, 28) for _ in prompts]
    arrive_at = [0 if i < 6 else rng.randint(1, 10) for i in range(len(prompts))]
    params = greedy(max_tokens)
    plain = run(scenario_engine(tiny_model, scenario), prompts, params, arrive_at)
    engine = scenario_engine(tiny_model, scenario, speculative=FIXED_K)
    assert run(engine, prompts, params, arrive_at) == plain
    stats = engine.scheduler.stats().spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both verdicts were seen
    tokens = {int(rid): got[0] for rid, got in plain.items()}
    check_against_oracle(oracle, prompts, max_tokens, tokens)
    if "preemption" in scenario:
        assert engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize("scenario", ["roomy", "chunked+preemption", "swap"])
@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
def test_seeded_sampling_with_replayed_drafts_changes_no_token(tiny_model, scenario, acceptance):
    """Drafts of the true continuation with a share corrupted: every accept/reject path,
    with filters, penalties and min_tokens, under preemption by recompute and by swap."""
    prompts = repetitive_prompts(7, 10)
    params = sampled(len(prompts), seed=7)

    plain = run(spec_scenario_engine(tiny_model, scenario), prompts, params)
    spec_engine = spec_scenario_engine(tiny_model, scenario, speculative=FIXED_K)
    outputs = {rid: got[0] for rid, got in plain.items()}
    vocab = spec_engine.runner_vocab_size()
    spec_engine.scheduler.speculator.proposer = ReplayProposer(outputs, acceptance, vocab)
    assert run(spec_engine, prompts, params) == plain
    stats = spec_engine.scheduler.stats().spec
    assert stats.num_draft_tokens > 0
    if acceptance == 1.0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif acceptance == 0.0:
        assert stats.num_accepted_tokens == 0
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if scenario == "swap":
        assert spec_engine.scheduler.num_swap_outs_total > 0


def test_prefix_cache_hits_after_speculation_change_no_token(tiny_model):
    """The second pass over the same prompts reads blocks the first pass cached while it
    speculated: no rejected draft was ever hashed into them."""
    prompts = repetitive_prompts(11, 8)
    params = greedy([24] * len(prompts))
    plain = run(build_engine(tiny_model, 4, 400), prompts, params)
    engine = build_engine(tiny_model, 4, 400, speculative=FIXED_K)
    first = run(engine, prompts, params)
    # The same prompts followed by their outputs: whole cached blocks hold speculated tokens.
    extended = [p + list(plain[str(i)][0]) for i, p in enumerate(prompts)]
    again = run(engine, extended, greedy([8] * len(prompts)))
    assert first == plain
    assert engine.scheduler.kv_cache.prefix_hits > 0
    assert again == run(build_engine(tiny_model, 4, 400), extended, greedy([8] * len(prompts)))


def test_stop_strings_and_stop_tokens_inside_a_verified_run(tiny_model):
    """Several tokens arrive in one step; a stop string or stop token among them ends the
    request where decoding without drafts would have, with the same text and counts."""
    prompts = repetitive_prompts(5, 6)
    plain = run(build_engine(tiny_model), prompts, greedy([30] * 6))
    params = []
    for i in range(6):
        tokens, text = plain[str(i)][0], plain[str(i)][1]
        stop = [text[len(text) // 2 : len(text) // 2 + 2]] if i % 2 == 0 and len(text) > 4 else []
        stop_ids = [tokens[15]] if i % 2 == 1 else []
        params.append(
            SamplingParams(temperature=0.0, max_tokens=30, stop=stop, stop_token_ids=stop_ids)
        )
    expected = run(build_engine(tiny_model), prompts, params)
    assert run(build_engine(tiny_model, speculative=FIXED_K), prompts, params) == expected
    assert any(reason == "stop" for _, _, reason, _ in expected.values())


@pytest.mark.parametrize("k", [1, 6])
def test_a_resumed_request_goes_on_identically_with_speculation(tiny_model, k):
    prompt = repetitive_prompts(13, 1)[0]
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=20, presence_penalty=0.3)
    whole = run(build_engine(tiny_model), [prompt], [params])["0"]
    engine = build_engine(tiny_model, speculative=FIXED_K)
    engine.add_prepared(engine.make_request("r", prompt, params, resume=Resume(whole[0][:k], 0)))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert whole[0][:k] + tokens == whole[0]


def test_a_request_may_opt_out(tiny_model):
    prompts = repetitive_prompts(17, 4)
    params = [SamplingParams(temperature=0.0, max_tokens=16, speculate=False)] * 4
    engine = build_engine(tiny_model, speculative=FIXED_K)
    assert run(engine, prompts, params) == run(build_engine(tiny_model), prompts, params)
    assert engine.scheduler.stats().spec.num_drafts == 0


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "speculative.num_speculative_tokens"),
        ({"method": "medusa"}, "speculative.method"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative.prompt_lookup_max"),
        ({"disable_by_batch_size": 0}, "speculative.disable_by_batch_size"),
        ({"method": "draft_model"}, "speculative.model"),
    ],
)
def test_bad_speculative_settings_fail_at_start_naming_the_field(tiny_model, fields, param):
    with pytest.raises(InvalidParam) as caught:
        build_engine(tiny_model, speculative=fields)
    assert caught.value.param == param


def test_deploy_yaml_speculative_block_is_strict():
    from pydantic import ValidationError

    from serve_app.engine_args import EngineArgs

    args = EngineArgs(speculative={"enabled": True, "num_speculative_tokens": 3})
    assert args.engine_config("m").speculative.num_speculative_tokens == 3
    with pytest.raises(ValidationError, match="speculative.num_speculativ_tokens"):
        EngineArgs(speculative={"num_speculativ_tokens": 3})
    with pytest.raises(ValidationError, match="speculative.method"):
        EngineArgs(speculative={"method": "eagle"})
    with pytest.raises(ValidationError, match="speculative.model"):
        EngineArgs(speculative={"method": "draft_model"})


def test_spec_decode_counters_reach_metrics_and_the_controllers_view(tiny_model):
    from functools import partial

    from prometheus_client.parser import text_string_to_metric_families

    from cluster.batching import make_policy
    from cluster.control import ClusterControl, ControlDecision, ReplicaStats
    from serve_app.observability.telemetry import render_engine_metrics

    engine = build_engine(tiny_model, speculative=FIXED_K)
    run(engine, repetitive_prompts(19, 4), greedy([20] * 4))
    spec = engine.stats().spec
    assert spec.num_drafts > 0 and sum(spec.accepted_per_position) == spec.num_accepted_tokens
    stats = ReplicaStats(replica_id="r1", scheduler=engine.stats(), num_streams=0, capacity=8)
    text = render_engine_metrics([("tiny", stats, ControlDecision(engine.scheduler.limits))])
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }
    assert samples[("dynabatch:spec_decode_num_drafts_total", None)] == spec.num_drafts
    assert samples[("dynabatch:spec_decode_num_draft_tokens_total", None)] == spec.num_draft_tokens
    accepted = samples[("dynabatch:spec_decode_num_accepted_tokens_total", None)]
    assert accepted == spec.num_accepted_tokens
    first = samples[("dynabatch:spec_decode_num_accepted_tokens_per_pos_total", "0")]
    assert first == spec.accepted_per_position[0]
    control = ClusterControl(partial(make_policy, "memory_aware", 8, None, None))
    control.report(stats, now=0.0)
    (row,) = control.view(now=0.0)["replicas"]
    assert row["spec_acceptance"] == spec.acceptance_rate
