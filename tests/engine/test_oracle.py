"""Greedy tokens of our engine equal HF generate for each prompt alone, whatever the batch,
chunk size, preemption, or the moment a request arrived."""

from __future__ import annotations

import random

import pytest

from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.conftest import build_engine, tiny_model_dir
from tests.engine.oracle import HFOracle


@pytest.fixture(scope="module")
def oracle(tiny_model) -> HFOracle:
    return HFOracle(tiny_model)


def random_prompts(seed: int, n: int, max_len: int, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def run_mix(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: list[int],
    arrive_at: list[int],
    loras: list[str | None] | None = None,
) -> dict[int, list[int]]:
    """Add prompt i at step arrive_at[i] (with LoRA adapter loras[i]); run until all finish;
    return tokens per prompt."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step_no = 0
    pending = sorted(range(len(prompts)), key=lambda i: arrive_at[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrive_at[pending[0]] <= step_no:
            i = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
            engine.add_request(str(i), prompts[i], params, lora=loras[i] if loras else None)
        for out in engine.step():
            tokens[int(out.request_id)].extend(out.new_token_ids)
        engine.scheduler.check_integrity()
        step_no += 1
    kv = engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    return tokens


def check_against_oracle(oracle, prompts, max_tokens, tokens) -> int:
    verdicts = [oracle.compare(p, tokens[i], max_tokens[i]) for i, p in enumerate(prompts)]
    near_ties = verdicts.count("near-tie")
    assert near_ties <= max(1, len(prompts) // 10), f"too many near-ties: {verdicts}"
    return near_ties


SCENARIOS = {
    # name: (block_size, num_blocks, max_num_batched_tokens, max_num_seqs, batching)
    "roomy": (16, 512, 2048, 64, "continuous"),
    "chunked-prefill": (4, 512, 7, 64, "continuous"),
    "preemption": (4, 36, 64, 16, "continuous"),
    "chunked+preemption": (2, 70, 13, 8, "continuous"),
    "narrow-batch": (8, 256, 256, 2, "continuous"),
    "static": (4, 512, 32, 4, "static"),
}


def scenario_engine(model: str, scenario: str, **engine_args) -> LLMEngine:
    """An engine sized and scheduled as SCENARIOS[scenario] says."""
    block_size, num_blocks, budget, max_seqs, batching = SCENARIOS[scenario]
    return build_engine(
        model,
        block_size,
        num_blocks,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        batching=batching,
        **engine_args,
    )


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_tokens_match_hf_generate(tiny_model, oracle, scenario, seed):
    engine = scenario_engine(tiny_model, scenario)
    rng = random.Random(seed)
    n = 14
    prompts = random_prompts(seed, n, max_len=50)
    max_tokens = [rng.randint(1, 24) for _ in range(n)]
    arrive_at = [0 if i < n // 2 else rng.randint(1, 12) for i in range(n)]
    tokens = run_mix(engine, prompts, max_tokens, arrive_at)
    check_against_oracle(oracle, prompts, max_tokens, tokens)
    if scenario.endswith("preemption"):
        assert engine.scheduler.num_preemptions_total > 0, "scenario meant to force preemption"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "llama3"])
@pytest.mark.parametrize("feature_major", [True, False])
def test_other_llama_family_architectures_match_hf(arch, feature_major):
    """Both activation layouts of the CPU decoder (feature-major is the default where the
    native ops build; token-major is the path every other device takes)."""
    model_dir = tiny_model_dir(arch)
    oracle = HFOracle(model_dir)
    engine = build_engine(model_dir, 4, 60, max_num_seqs=8, max_num_batched_tokens=16)
    if not feature_major:
        engine.runner.model.unpack_weights()  # token-major reads row-major weights
        engine.runner.model.feature_major_max_tokens = 0
    prompts = random_prompts(7, 8, max_len=40)
    max_tokens = [16] * len(prompts)
    tokens = run_mix(engine, prompts, max_tokens, [0, 0, 0, 0, 2, 4, 6, 8])
    check_against_oracle(oracle, prompts, max_tokens, tokens)


def check_sliding_window_model(backend: str, device: str = "cpu") -> None:
    """Mistral with a 12-token window over prompts up to 40 tokens: chunked prefill (chunks
    longer than the window, chunks resuming past it) and decodes see only the window."""
    model_dir = tiny_model_dir("mistral-window")
    engine = build_engine(
        model_dir,
        4,
        80,
        device=device,
        attention_backend=backend,
        max_num_seqs=6,
        max_num_batched_tokens=20,
    )
    assert engine.runner.spec.sliding_window == 12
    prompts = random_prompts(8, 6, max_len=40)
    max_tokens = [14] * len(prompts)
    tokens = run_mix(engine, prompts, max_tokens, [0, 0, 0, 1, 3, 5])
    check_against_oracle(HFOracle(model_dir), prompts, max_tokens, tokens)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_sliding_window_model_matches_hf(backend):
    check_sliding_window_model(backend)
