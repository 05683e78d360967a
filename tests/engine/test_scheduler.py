"""Scheduler and KV manager behaviour on hand-built runner outputs (no model, no torch)."""

from __future__ import annotations

import pytest

from engine.core.config import SchedulerLimits
from engine.core.request import RequestStatus
from tests.engine.helpers import EOS, make_request, make_scheduler, run_to_end, step


def test_prefill_then_decode_one_token_per_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt_len=10, max_tokens=3))
    out, results = step(sched)
    assert [(s.request_id, s.num_tokens, s.sample) for s in out.scheduled] == [("a", 10, True)]
    assert results[0].new_token_ids == [7]
    out, _ = step(sched)
    assert out.scheduled[0].num_tokens == 1
    assert out.scheduled[0].num_computed_tokens == 10
    _, results = step(sched)
    assert results[0].finish_reason == "length"
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def test_long_prompt_is_chunked_by_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", prompt_len=20, max_tokens=2))
    chunks = []
    for _ in range(3):
        out, results = step(sched)
        chunks.append((out.scheduled[0].num_computed_tokens, out.scheduled[0].num_tokens))
    assert chunks == [(0, 8), (8, 8), (16, 4)]
    assert results and results[0].new_token_ids == [7]  # sampled only at the end of the prompt


def test_running_requests_come_before_waiting_ones_within_the_budget():
    sched = make_scheduler(max_num_batched_tokens=12)
    sched.add_request(make_request("a", prompt_len=10, max_tokens=5))
    step(sched)
    sched.add_request(make_request("b", prompt_len=30, max_tokens=5))
    out, _ = step(sched)
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 11)]
    assert out.num_batched_tokens == 12


def test_max_num_seqs_caps_the_batch_and_set_limits_moves_it():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abcd":
        sched.add_request(make_request(rid, prompt_len=4, max_tokens=10))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    sched.set_limits(SchedulerLimits(max_num_seqs=3, max_num_batched_tokens=64))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]
    # Lowering the cap evicts nobody; it only stops admission.
    sched.set_limits(SchedulerLimits(max_num_seqs=1, max_num_batched_tokens=64))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]


def test_out_of_blocks_preempts_the_youngest_and_resumes_it_by_recompute():
    # 6 blocks of 4 tokens; two requests of 8-token prompts + 12 outputs need 5 blocks each.
    sched = make_scheduler(num_blocks=6, block_size=4)
    sched.add_request(make_request("old", prompt_len=8, max_tokens=12))
    sched.add_request(make_request("young", prompt_len=8, max_tokens=12))
    preempted_at = None
    for i in range(40):
        out, _ = step(sched)
        if out.preempted_request_ids:
            preempted_at = i
            assert out.preempted_request_ids == ["young"]
            assert sched.requests["young"].status == RequestStatus.PREEMPTED
            assert sched.requests["young"].num_computed_tokens == 0
            break
    assert preempted_at is not None
    run_to_end(sched)
    assert sched.kv_cache.num_free_blocks == 6
    assert sched.num_preemptions_total >= 1


def test_recompute_after_preemption_covers_prompt_and_outputs():
    sched = make_scheduler(num_blocks=6, block_size=4)
    sched.add_request(make_request("old", prompt_len=8, max_tokens=12))
    sched.add_request(make_request("young", prompt_len=8, max_tokens=12))
    young = sched.requests["young"]
    outputs_before = None
    while young.status != RequestStatus.PREEMPTED:
        outputs_before = young.num_output_tokens
        step(sched)
    # When it comes back, its first chunk recomputes prompt + outputs made so far.
    while True:
        out, _ = step(sched)
        mine = [s for s in out.scheduled if s.request_id == "young"]
        if mine:
            assert mine[0].num_computed_tokens == 0
            assert mine[0].num_tokens == 8 + outputs_before
            assert mine[0].sample
            break
    run_to_end(sched)


def test_eos_stops_unless_ignored_and_min_tokens_bans_it():
    sched = make_scheduler()
    sched.add_request(make_request("stops", 4, max_tokens=10, ignore_eos=False))
    sched.add_request(make_request("ignores", 4, max_tokens=3, ignore_eos=True))
    sched.add_request(make_request("min", 4, max_tokens=10, ignore_eos=False, min_tokens=2))
    out = sched.schedule()
    banned = {s.request_id: s.banned_token_ids for s in out.scheduled}
    assert banned == {"stops": (), "ignores": (), "min": (EOS,)}
    from engine.core.outputs import ModelRunnerOutput

    results = sched.update_from_output(
        out, ModelRunnerOutput({"stops": EOS, "ignores": EOS, "min": 5})
    )
    reasons = {r.request_id: r.finish_reason for r in results}
    assert reasons == {"stops": "stop", "ignores": None, "min": None}


def test_stop_token_ids_finish_with_stop():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=10, stop_token_ids=[7]))
    _, results = step(sched, token=7)
    assert results[0].finish_reason == "stop"
    assert not sched.has_unfinished_requests()


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 10, max_tokens=10))
    sched.add_request(make_request("wait", 10, max_tokens=10))
    step(sched)
    assert sched.kv_cache.num_free_blocks < sched.kv_cache.num_blocks
    sched.abort_requests(["run", "wait", "unknown"])
    sched.check_integrity()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    out = sched.schedule()
    assert out.is_empty and set(out.finished_request_ids) == {"run", "wait"}


def test_static_batching_admits_the_next_batch_only_when_the_last_one_ends():
    sched = make_scheduler(max_num_seqs=2, batching="static")
    sched.add_request(make_request("a", 4, max_tokens=1))
    sched.add_request(make_request("b", 4, max_tokens=3))
    sched.add_request(make_request("c", 4, max_tokens=1))
    seen = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        seen.append(sorted(s.request_id for s in out.scheduled))
    assert seen == [["a", "b"], ["b"], ["b"], ["c"]]


def test_continuous_batching_refills_the_batch_at_once():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("a", 4, max_tokens=1))
    sched.add_request(make_request("b", 4, max_tokens=3))
    sched.add_request(make_request("c", 4, max_tokens=1))
    out, _ = step(sched)
    out, _ = step(sched)
    assert sorted(s.request_id for s in out.scheduled) == ["b", "c"]


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "field"),
    [(0, 4, "prompt"), (255, 10, "max_model_len"), (200, 56, "KV blocks")],
)
def test_requests_that_could_never_run_are_refused(prompt_len, max_tokens, field):
    sched = make_scheduler(num_blocks=50, block_size=4, max_model_len=260)
    with pytest.raises(ValueError, match=field):
        sched.add_request(make_request("x", prompt_len, max_tokens=max_tokens))
    assert not sched.has_unfinished_requests()


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_request("a", 4))
