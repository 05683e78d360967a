"""The graph-replayed decode path end to end on the CPU (tests/engine/replayed_graphs.py:
CUDA graphs' replay semantics, the `triton` backend under Triton's interpreter): decode
steps padded to a captured size and replayed from the persistent buffers, the step launched
before the previous one is collected taking its input tokens on the device, and mixed steps
run eagerly in between; greedy tokens equal transformers' whatever the scheduling."""

from __future__ import annotations

import os

import pytest

# NOTE: read when the kernels are defined, so before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.engine.oracle import HFOracle  # noqa: E402
from tests.engine.replayed_graphs import replay_decodes  # noqa: E402
from tests.engine.test_oracle import (  # noqa: E402
    check_against_oracle,
    random_prompts,
    run_mix,
    scenario_engine,
)


@pytest.fixture(scope="module")
def oracle(tiny_model) -> HFOracle:
    return HFOracle(tiny_model)


@pytest.mark.parametrize("scenario", ["roomy", "chunked+preemption"])
def test_replayed_decode_steps_match_hf(tiny_model, oracle, scenario):
    engine = scenario_engine(tiny_model, scenario, attention_backend="triton", deferred_steps=True)
    graphs = replay_decodes(engine, largest=8)
    prompts = random_prompts(3, 10, max_len=40)
    max_tokens = [3 + (7 * i) % 17 for i in range(len(prompts))]
    arrive_at = [0] * 5 + [2, 4, 9, 15, 22]
    tokens = run_mix(engine, prompts, max_tokens, arrive_at)
    check_against_oracle(oracle, prompts, max_tokens, tokens)
    replays = graphs.replays()
    # Batches shrink as requests end: several sizes replay, padded ones among them.
    assert sum(replays.values()) > 10 and len(replays) > 1, replays
    assert engine.core.num_continuations > 3  # input tokens taken on the device
    if scenario.endswith("preemption"):
        assert engine.scheduler.num_preemptions_total > 0
