"""Tensor parallelism over NCCL (skipped below two GPUs): two ranks give one rank's greedy
tokens on the oracle scenarios, and one-GPU engines stay as they were."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import REPO
from tests.engine.test_oracle import random_prompts, run_mix, scenario_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="NCCL tensor parallelism needs 2 GPUs",
    ),
]


@pytest.mark.parametrize("scenario", ["roomy", "chunked+preemption"])
def test_two_gpus_give_the_tokens_of_one(scenario):
    from engine.model.tiny_model import make_model

    model = str(make_model(REPO / "models" / "tiny-wide", size="tiny-wide"))
    rng = random.Random(0)
    prompts = random_prompts(0, 12, max_len=40)
    max_tokens = [rng.randint(1, 20) for _ in prompts]
    arrive_at = [rng.randint(0, 6) for _ in prompts]
    tokens = []
    for world in (1, 2):
        engine = scenario_engine(
            model, scenario, device="cuda", attention_backend="torch", tensor_parallel_size=world
        )
        try:
            tokens.append(run_mix(engine, prompts, max_tokens, arrive_at))
        finally:
            engine.close()
    assert tokens[0] == tokens[1]
