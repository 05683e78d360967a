"""Prefix caching: shared physical blocks, LRU revival and eviction, and the oracle (greedy
outputs identical with caching on and off, and equal to transformers)."""

from __future__ import annotations

import random

import pytest

from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.sched.scheduler import Scheduler
from tests.conftest import build_engine
from tests.engine.helpers import fake_run
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import check_against_oracle, run_mix


def scheduler(num_blocks: int = 64, block_size: int = 4, caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, caching))


def request(rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params)


def run_to_end(sched: Scheduler) -> None:
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, fake_run(out))
        sched.check_integrity()


PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4, and 2 more


def test_second_request_reuses_the_freed_blocks_of_the_first():
    sched = scheduler()
    sched.add_request(request("a", PROMPT))
    run_to_end(sched)
    sched.add_request(request("b", PROMPT + [5, 6]))
    out = sched.schedule()
    (b,) = out.scheduled
    # 20 tokens: 4 cached full blocks (16 tokens), 4 computed.
    assert b.num_computed_tokens == 16 and len(b.token_ids) == 4
    stats = sched.stats()
    assert stats.prefix_cache_hits == 16 and stats.prefix_cache_queries == 18 + 20
    sched.update_from_output(out, fake_run(out))
    sched.check_integrity()
    # What each request found cached at admission (the traffic trace's cached_prompt_len).
    assert sched.requests["b"].num_cached_prompt_tokens == 16


def test_a_preempted_request_counts_only_what_it_found_cached_at_first():
    """The blocks a preempted request gets back from the cache are its own, not a hit."""
    sched = scheduler(num_blocks=12)
    old = request("old", PROMPT, max_tokens=20)
    young = request("young", list(range(500, 516)), max_tokens=20)
    for r in (old, young):
        sched.add_request(r)
    preempted = set()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted.update(out.preempted_request_ids)
        sched.update_from_output(out, fake_run(out))
    assert preempted
    assert (old.num_cached_prompt_tokens, young.num_cached_prompt_tokens) == (0, 0)


def test_an_identical_prompt_still_computes_its_last_token():
    sched = scheduler()
    sched.add_request(request("a", PROMPT[:16]))
    run_to_end(sched)
    sched.add_request(request("b", PROMPT[:16]))
    (b,) = sched.schedule().scheduled
    # All 4 blocks are cached, but the last token's logits are needed: 3 blocks reused.
    assert b.num_computed_tokens == 12 and b.token_ids == PROMPT[12:16] and b.sample


def test_running_requests_share_physical_blocks_with_ref_counts():
    sched = scheduler()
    sched.add_request(request("a", PROMPT, max_tokens=8))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))  # a's prompt is computed and registered
    sched.add_request(request("b", PROMPT + [9], max_tokens=8))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))
    kv = sched.kv_cache
    shared = set(kv.block_ids("a")[:4]) & set(kv.block_ids("b")[:4])
    assert len(shared) == 4
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in shared)
    sched.check_integrity()
    run_to_end(sched)
    assert kv.num_free_blocks == kv.num_blocks  # every reference returned


def test_partial_overlap_reuses_only_the_matching_blocks():
    sched = scheduler()
    sched.add_request(request("a", PROMPT))
    run_to_end(sched)
    diverged = PROMPT[:9] + [7] * 9  # block 0, block 1 match; block 2 differs at its 2nd token
    sched.add_request(request("b", diverged))
    (b,) = sched.schedule().scheduled
    assert b.num_computed_tokens == 8


def test_lru_eviction_takes_the_least_recently_freed_blocks():
    sched = scheduler(num_blocks=10)
    sched.add_request(request("old", list(range(200, 216)), max_tokens=1))  # 4 blocks + 1
    run_to_end(sched)
    sched.add_request(request("new", list(range(300, 316)), max_tokens=1))
    run_to_end(sched)
    # 10 blocks: "old" (freed first) then "new" sit in the free queue. A 24-token request
    # needs 7 blocks: it evicts from the least recently freed end, i.e. "old"'s blocks first.
    sched.add_request(request("big", list(range(400, 424)), max_tokens=1))
    run_to_end(sched)
    sched.add_request(request("new2", list(range(300, 316)) + [1], max_tokens=1))
    (n2,) = sched.schedule().scheduled
    assert n2.num_computed_tokens > 0  # "new" survived
    run_to_end(sched)
    sched.add_request(request("old2", list(range(200, 216)) + [1], max_tokens=1))
    (o2,) = sched.schedule().scheduled
    assert o2.num_computed_tokens == 0  # "old" was evicted


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    sched = scheduler(num_blocks=12)
    sched.add_request(request("old", PROMPT, max_tokens=20))  # 18 + 20 tokens: 10 blocks
    sched.add_request(request("young", list(range(500, 516)), max_tokens=20))
    preempted_at = None
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if out.preempted_request_ids and preempted_at is None:
            preempted_at = out.preempted_request_ids[0]
        mine = [s for s in out.scheduled if s.request_id == preempted_at]
        if preempted_at and mine and sched.requests[preempted_at].num_preemptions:
            # Back after preemption: its head blocks were still cached (freed tail first,
            # they sat at the recently-used end of the queue), so it did not restart at 0.
            assert mine[0].num_computed_tokens > 0
            break
        sched.update_from_output(out, fake_run(out))
        sched.check_integrity()
    assert preempted_at is not None


def test_caching_off_never_hits():
    sched = scheduler(caching=False)
    sched.add_request(request("a", PROMPT))
    run_to_end(sched)
    sched.add_request(request("b", PROMPT))
    (b,) = sched.schedule().scheduled
    assert b.num_computed_tokens == 0 and sched.stats().prefix_cache_hits == 0


# ------------------------------------------------------------------------------ oracle
@pytest.fixture(scope="module")
def oracle(tiny_model) -> HFOracle:
    return HFOracle(tiny_model)


def shared_prefix_workload(seed: int) -> tuple[list[list[int]], list[int], list[int]]:
    """A shared system prompt with unique suffixes, exact repeats arriving later, and
    prompts that overlap a earlier one only partly."""
    rng = random.Random(seed)
    system = [rng.randrange(4096) for _ in range(37)]
    prompts = [system + [rng.randrange(4096) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    prompts += [list(prompts[i]) for i in (0, 3)]  # repeats
    prompts += [prompts[1][: rng.randint(5, 30)] + [rng.randrange(4096) for _ in range(6)]]
    prompts += [system[:20]]  # a prefix of the system prompt alone
    max_tokens = [rng.randint(2, 16) for _ in prompts]
    arrive_at = [0] * 4 + [rng.randint(1, 30) for _ in range(len(prompts) - 4)]
    return prompts, max_tokens, arrive_at


SCENARIOS = {
    # name: (block_size, num_blocks, max_num_batched_tokens, max_num_seqs)
    "roomy": (4, 400, 256, 16),
    "chunked": (4, 400, 9, 16),
    "preemption": (4, 24, 64, 16),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("seed", [0, 1])
def test_outputs_identical_with_caching_on_and_off(tiny_model, oracle, scenario, seed):
    block_size, num_blocks, budget, max_seqs = SCENARIOS[scenario]
    prompts, max_tokens, arrive_at = shared_prefix_workload(seed)
    runs = {}
    for caching in (True, False):
        engine = build_engine(
            tiny_model,
            block_size,
            num_blocks,
            enable_prefix_caching=caching,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
        )
        runs[caching] = (run_mix(engine, prompts, max_tokens, arrive_at), engine.scheduler)
    (on, sched_on), (off, sched_off) = runs[True], runs[False]
    assert on == off
    check_against_oracle(oracle, prompts, max_tokens, on)
    assert sched_on.stats().prefix_cache_hits > 0 and sched_off.stats().prefix_cache_hits == 0
    if scenario == "preemption":
        assert sched_on.num_preemptions_total > 0, "scenario meant to force preemption"


def test_the_finished_delta_says_how_much_of_the_prompt_was_cached(tiny_model):
    engine = build_engine(tiny_model, block_size=4, num_blocks=100)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    cached = []
    for rid in ("first", "second"):
        engine.add_request(rid, PROMPT, params)
        lasts = []
        while engine.has_unfinished_requests():
            lasts += [out for out in engine.step() if out.finished]
        cached.append(lasts[0].num_cached_tokens)
    assert cached == [0, 16]  # the second found the first's 4 full blocks
