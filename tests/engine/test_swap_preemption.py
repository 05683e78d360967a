"""Swap preemption: KV copied to a host pool and back, recompute when the host pool is full,
integrity of both pools after every step, and the oracle under forced swapping."""

from __future__ import annotations

import random

import pytest

from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.sched.scheduler import Scheduler
from tests.conftest import build_engine
from tests.engine.helpers import fake_run
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import check_against_oracle, random_prompts, run_mix


def make(num_blocks: int, num_host_blocks: int) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, preemption_mode="swap"
    )
    return Scheduler(config, KVCacheManager(num_blocks, 4, False, num_host_blocks))


def req(rid: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(20, 20 + prompt_len)), params)


def drive(sched: Scheduler) -> list:
    """Run to the end; every step's output; integrity of both pools after each."""
    outs = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        outs.append(out)
        sched.update_from_output(out, fake_run(out))
        sched.check_integrity()
    kv = sched.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_host_blocks == kv.host_pool.num_blocks
    return outs


def test_swapped_request_keeps_its_progress_and_comes_back():
    sched = make(num_blocks=8, num_host_blocks=16)
    sched.add_request(req("old", 8, 14))  # grows to 22 tokens: 6 blocks
    sched.add_request(req("young", 8, 14))
    seen_swapped = False
    outs = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        outs.append(out)
        young = sched.requests.get("young")
        if young is not None and young.status == RequestStatus.SWAPPED:
            seen_swapped = True
            assert young.num_computed_tokens > 0  # progress kept
            assert out.blocks_to_swap_out or any(o.blocks_to_swap_out for o in outs)
        sched.update_from_output(out, fake_run(out))
        sched.check_integrity()
    assert seen_swapped
    swap_outs = [p for o in outs for p in o.blocks_to_swap_out]
    swap_ins = [p for o in outs for p in o.blocks_to_swap_in]
    assert swap_outs and len(swap_ins) == len(swap_outs)
    # Copied back from the same host blocks it went to.
    assert sorted(h for _, h in swap_outs) == sorted(h for h, _ in swap_ins)
    back = next(o for o in outs if o.blocks_to_swap_in)
    (young,) = [s for s in back.scheduled if s.request_id == "young"]
    assert young.num_computed_tokens > 0  # resumed where it stopped, no recompute
    kv = sched.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_host_blocks == kv.host_pool.num_blocks
    assert sched.stats().num_swap_outs_total >= 1


def test_full_host_pool_falls_back_to_recompute():
    sched = make(num_blocks=8, num_host_blocks=2)  # too small for young's 3+ blocks
    sched.add_request(req("old", 8, 14))
    sched.add_request(req("young", 8, 14))
    outs = drive(sched)
    assert sched.num_preemptions_total >= 1
    assert not any(o.has_swaps for o in outs)
    assert sched.stats().num_swap_outs_total == 0


def test_aborting_a_swapped_request_frees_its_host_blocks():
    sched = make(num_blocks=8, num_host_blocks=16)
    sched.add_request(req("old", 8, 14))
    sched.add_request(req("young", 8, 14))
    while "young" not in sched.requests or sched.requests["young"].status != RequestStatus.SWAPPED:
        out = sched.schedule()
        sched.update_from_output(out, fake_run(out))
    assert sched.kv_cache.num_free_host_blocks < 16
    sched.abort_requests(["young"])
    sched.check_integrity()
    assert sched.kv_cache.num_free_host_blocks == 16
    drive(sched)


@pytest.fixture(scope="module")
def oracle(tiny_model) -> HFOracle:
    return HFOracle(tiny_model)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_identical_under_forced_swapping(tiny_model, oracle, seed, caching):
    rng = random.Random(seed)
    n = 12
    prompts = random_prompts(seed, n, max_len=40)
    max_tokens = [rng.randint(4, 24) for _ in range(n)]
    arrive_at = [0 if i < n // 2 else rng.randint(1, 10) for i in range(n)]
    runs = {}
    for mode in ("swap", "recompute"):
        engine = build_engine(
            tiny_model,
            block_size=4,
            num_blocks=30,
            num_host_blocks=64,
            enable_prefix_caching=caching,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            preemption_mode=mode,
        )
        runs[mode] = (run_mix(engine, prompts, max_tokens, arrive_at), engine.scheduler)
    (swapped, sched), (recomputed, _) = runs["swap"], runs["recompute"]
    assert sched.stats().num_swap_outs_total > 0, "the case must force swapping"
    assert swapped == recomputed
    check_against_oracle(oracle, prompts, max_tokens, swapped)
    kv = sched.kv_cache
    assert kv.num_free_host_blocks == kv.host_pool.num_blocks
