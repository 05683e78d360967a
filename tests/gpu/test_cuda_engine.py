"""The engine on a CUDA device still matches HF greedy decoding (skipped without CUDA): every
oracle scenario (chunked prefill, preemption, static batching), preemption by swap to host
memory, the other Llama-family architectures, seeded sampling, and bf16 serving."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.conftest import build_engine, tiny_model_dir
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import SCENARIOS, check_against_oracle, random_prompts, run_mix

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def oracle(tiny_model) -> HFOracle:
    return HFOracle(tiny_model)


def mixed_requests(seed: int, n: int = 14) -> tuple[list[list[int]], list[int], list[int]]:
    rng = random.Random(seed)
    prompts = random_prompts(seed, n, max_len=50)
    max_tokens = [rng.randint(1, 24) for _ in range(n)]
    arrive_at = [0 if i < n // 2 else rng.randint(1, 12) for i in range(n)]
    return prompts, max_tokens, arrive_at


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_tokens_match_hf_on_cuda(tiny_model, oracle, scenario, backend):
    """float32: the triton kernel's dots run in IEEE float32 (no TF32), so token-exact."""
    if backend == "triton":
        pytest.importorskip("triton")
    block_size, num_blocks, budget, max_seqs, batching = SCENARIOS[scenario]
    engine = build_engine(
        tiny_model,
        block_size,
        num_blocks,
        device="cuda",
        attention_backend=backend,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        batching=batching,
    )
    prompts, max_tokens, arrive_at = mixed_requests(0)
    tokens = run_mix(engine, prompts, max_tokens, arrive_at)
    check_against_oracle(oracle, prompts, max_tokens, tokens)
    if scenario.endswith("preemption"):
        assert engine.scheduler.num_preemptions_total > 0


def test_swap_preemption_on_cuda_matches_hf(tiny_model, oracle):
    """Preempted requests' blocks go to pinned host memory and come back to the GPU."""
    engine = build_engine(
        tiny_model,
        block_size=4,
        num_blocks=30,
        num_host_blocks=64,
        device="cuda",
        max_num_seqs=8,
        max_num_batched_tokens=32,
        preemption_mode="swap",
    )
    prompts, max_tokens, arrive_at = mixed_requests(1, n=12)
    tokens = run_mix(engine, prompts, max_tokens, arrive_at)
    check_against_oracle(oracle, prompts, max_tokens, tokens)
    kv = engine.scheduler.kv_cache
    assert engine.scheduler.stats().num_swap_outs_total > 0, "the case must force swapping"
    assert kv.num_free_host_blocks == kv.host_pool.num_blocks


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "llama3"])
def test_other_architectures_match_hf_on_cuda(arch):
    model_dir = tiny_model_dir(arch)
    oracle = HFOracle(model_dir)
    engine = build_engine(
        model_dir, 4, 60, device="cuda", max_num_seqs=8, max_num_batched_tokens=16
    )
    prompts = random_prompts(7, 8, max_len=40)
    max_tokens = [16] * len(prompts)
    tokens = run_mix(engine, prompts, max_tokens, [0, 0, 0, 0, 2, 4, 6, 8])
    check_against_oracle(oracle, prompts, max_tokens, tokens)


def test_seeded_sampling_repeats_on_cuda(tiny_model):
    engine = build_engine(tiny_model, 16, 200, device="cuda")
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=24)
    prompts = random_prompts(3, 4, max_len=30)
    first = [r.token_ids for r in engine.generate(prompts, params)]
    again = [r.token_ids for r in engine.generate(prompts, params)]
    assert first == again
    assert len({tuple(t) for t in first}) > 1


def test_bfloat16_on_cuda_serves_and_frees_every_block(tiny_model):
    """bf16 tokens can differ from float32 HF, so this checks the serving contract: every
    request gets its tokens, the first ones mostly agree with HF, no block leaks."""
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model,
            device="cuda",
            dtype="bfloat16",
            cache=CacheConfig(block_size=16, kv_cache_bytes=None, gpu_memory_fraction=0.2),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
        )
    )
    check_half_precision_serving(engine, tiny_model)


def check_half_precision_serving(engine: LLMEngine, model_dir: str) -> None:
    """Every request gets its tokens, the first ones mostly agree with float32 HF, and every
    block comes back."""
    oracle = HFOracle(model_dir)
    prompts = random_prompts(5, 12, max_len=60)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert [len(r.token_ids) for r in results] == [20] * len(prompts)
    first_agree = sum(
        r.token_ids[0] == oracle.greedy(p, 20)[0] for p, r in zip(prompts, results, strict=True)
    )
    assert first_agree >= len(prompts) * 3 // 4
    kv = engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_sliding_window_model_matches_hf_on_cuda(backend):
    from tests.engine.test_oracle import check_sliding_window_model

    if backend == "triton":
        pytest.importorskip("triton")
    check_sliding_window_model(backend, device="cuda")


def test_the_profiled_kv_cache_leaves_room_for_the_largest_step(tiny_model):
    """No kv_cache_bytes: the cache takes gpu_memory_fraction of the GPU minus the weights and
    the profiled peak, and the largest step then runs within that fraction."""
    from engine.runner.kv_budget import run_largest_step

    fraction = 0.3
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model,
            device="cuda",
            dtype="bfloat16",
            cache=CacheConfig(block_size=16, gpu_memory_fraction=fraction),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
        )
    )
    runner = engine.runner
    _, total = torch.cuda.mem_get_info()
    cache_bytes = runner.num_kv_blocks() * runner.bytes_per_block()
    assert cache_bytes > 0.8 * fraction * total  # the tiny model's weights are negligible
    torch.cuda.reset_peak_memory_stats()
    run_largest_step(runner.device_model(), engine.scheduler.config, runner.max_model_len())
    assert torch.cuda.max_memory_allocated() <= fraction * total


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_cuda_graphs_on_and_off_give_the_same_greedy_tokens(tiny_model, oracle, scenario):
    """Decode steps replay captured graphs (triton backend) or run eagerly: the same tokens,
    and HF's."""
    pytest.importorskip("triton")
    block_size, num_blocks, budget, max_seqs, batching = SCENARIOS[scenario]
    runs = []
    for eager in (False, True):
        engine = LLMEngine(
            EngineConfig(
                model=tiny_model,
                device="cuda",
                attention_backend="triton",
                enforce_eager=eager,
                cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_seqs, max_num_batched_tokens=budget, batching=batching
                ),
            )
        )
        assert (engine.runner.graphs is None) == eager
        prompts, max_tokens, arrive_at = mixed_requests(0)
        runs.append(run_mix(engine, prompts, max_tokens, arrive_at))
    assert runs[0] == runs[1]
    check_against_oracle(oracle, prompts, max_tokens, runs[0])


def test_seeded_sampling_on_cuda_is_the_same_in_any_batch(tiny_model):
    """A seeded request draws the same tokens alone and amid others with other parameters,
    at any position in the batch, graphs replaying or not."""
    pytest.importorskip("triton")
    engine = build_engine(tiny_model, 16, 200, device="cuda", attention_backend="triton")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    prompt = random_prompts(9, 1, max_len=30)[0]
    alone = engine.generate([prompt], params)[0].token_ids
    others = random_prompts(10, 7, max_len=40)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=9),
        SamplingParams(temperature=1.2, min_p=0.05, max_tokens=20),
    ]
    other_params = [kinds[i % 3] for i in range(7)]
    for at in (0, 3, 7):
        prompts = [*others[:at], prompt, *others[at:]]
        batch = engine.generate(prompts, [*other_params[:at], params, *other_params[at:]])
        assert batch[at].token_ids == alone
