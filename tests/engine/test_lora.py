"""LoRA adapters: mixed batches (adapters and base interleaved, chunked prefill, preemption,
more adapters than slots) give each prompt the greedy tokens of transformers' generate on
the PEFT-merged model alone; the prefix cache never shares blocks across adapters."""

from __future__ import annotations

import random

import pytest

from engine.core.sampling_params import SamplingParams
from engine.lora import segments
from engine.model.tiny_model import make_model
from tests.conftest import REPO, build_engine
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import random_prompts, run_mix, scenario_engine
from tests.lora_adapters import lora_adapters

CYCLE = ["sql", None, "chat", "code"]


@pytest.fixture(scope="module")
def adapters(tiny_model) -> dict[str, str]:
    return lora_adapters(tiny_model)


@pytest.fixture(scope="module")
def oracles(tiny_model, adapters) -> dict[str | None, HFOracle]:
    found = {name: HFOracle(tiny_model, path) for name, path in adapters.items()}
    return {None: HFOracle(tiny_model), **found}


def lora_engine(model: str, scenario: str, adapters: dict[str, str], device: str = "cpu", **lora):
    return scenario_engine(model, scenario, device=device, lora={"adapters": adapters, **lora})


def check_mix(oracles, prompts, max_tokens, loras, tokens) -> None:
    """Each prompt's tokens are its adapter's; the adapters change the output."""
    changed = set()
    for i, prompt in enumerate(prompts):
        oracle = oracles[loras[i]]
        assert oracle.compare(prompt, tokens[i], max_tokens[i]) == "equal", (i, loras[i])
        if loras[i] and tokens[i] != oracles[None].greedy(prompt, max_tokens[i]):
            changed.add(loras[i])
    assert changed == {name for name in loras if name}, f"adapters that changed nothing: {changed}"


@pytest.mark.parametrize(
    ("scenario", "max_loras", "path"),
    [
        ("roomy", 4, "feature-major"),  # the CPU decoder's path for steps of few tokens
        ("roomy", 4, "token-major"),  # large steps, and other devices
        ("roomy", 3, "one-by-one"),  # no segments batched
        ("chunked+preemption", 2, "feature-major"),
        ("preemption", 1, "feature-major"),  # more adapters than slots: requests wait or evict
    ],
)
def test_mixed_batches_match_peft_merged(
    tiny_model, adapters, oracles, monkeypatch, scenario, max_loras, path
):
    engine = lora_engine(tiny_model, scenario, adapters, max_loras=max_loras)
    if path == "token-major":
        engine.runner.model.feature_major_max_tokens = 0
    if path == "one-by-one":
        monkeypatch.setattr(segments, "MIN_BATCHED", 10**9)
    rng = random.Random(max_loras)
    n = 12
    prompts = random_prompts(max_loras, n, max_len=50)
    max_tokens = [rng.randint(6, 16) for _ in range(n)]
    arrive_at = [0 if i < n // 2 else rng.randint(1, 10) for i in range(n)]
    loras = [CYCLE[i % len(CYCLE)] for i in range(n)]
    tokens = run_mix(engine, prompts, max_tokens, arrive_at, loras)
    check_mix(oracles, prompts, max_tokens, loras, tokens)
    # Three adapters, each loaded at least once (through one slot: two evictions at least).
    assert engine.scheduler.loras.num_loads_total >= 3
    if scenario.endswith("preemption"):
        assert engine.scheduler.num_preemptions_total > 0


def test_steps_launched_before_the_one_before_is_collected_keep_each_rows_adapter(
    tiny_model, adapters, oracles
):
    """As on a GPU: a step launched while the one before is in flight (a continuation) runs
    each row with its adapter."""
    lora = {"adapters": adapters, "max_loras": 2}
    engine = scenario_engine(tiny_model, "roomy", deferred_steps="at_launch", lora=lora)
    rng = random.Random(3)
    n = 12
    prompts = random_prompts(3, n, max_len=40)
    max_tokens = [rng.randint(4, 16) for _ in range(n)]
    loras = [CYCLE[i % len(CYCLE)] for i in range(n)]
    tokens = run_mix(engine, prompts, max_tokens, [0] * n, loras)
    assert engine.core.num_continuations > 0
    check_mix(oracles, prompts, max_tokens, loras, tokens)


def test_prefix_cache_never_shares_blocks_across_adapters(tiny_model, adapters, oracles):
    engine = lora_engine(tiny_model, "roomy", adapters)
    kv = engine.scheduler.kv_cache
    prompt = random_prompts(7, 1, max_len=2)[0] * 40  # 80 tokens: five full blocks
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    hits = []
    for lora in ("sql", "chat", None, "sql", None):
        (result,) = engine.generate([prompt], params, [lora])
        assert result.token_ids == oracles[lora].greedy(prompt, 5), lora
        hits.append(kv.prefix_hits)
    # Only the second run of an adapter (and of the base) finds cached blocks.
    assert hits[0] == hits[1] == hits[2] == 0
    assert hits[3] > hits[2] and hits[4] > hits[3]
    engine.scheduler.check_integrity()


def test_tensor_parallel_two_ranks_match_peft_merged():
    """Two gloo ranks shard A and B like the layers they adapt."""
    wide = str(make_model(REPO / "models" / "tiny-wide", size="tiny-wide"))
    adapters = lora_adapters(wide)
    engine = build_engine(
        wide,
        2,
        70,
        tensor_parallel_size=2,
        max_num_batched_tokens=13,
        max_num_seqs=8,
        lora={"adapters": adapters, "max_loras": 2},
    )
    try:
        n = 8
        prompts = random_prompts(3, n, max_len=30)
        max_tokens = [8] * n
        loras = [CYCLE[i % len(CYCLE)] for i in range(n)]
        tokens = run_mix(engine, prompts, max_tokens, [0] * n, loras)
    finally:
        engine.close()
    oracles = {None: HFOracle(wide), **{k: HFOracle(wide, p) for k, p in adapters.items()}}
    check_mix(oracles, prompts, max_tokens, loras, tokens)
