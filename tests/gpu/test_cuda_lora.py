"""LoRA adapters on CUDA: the Triton kernels pass the start-up self-check, and mixed batches
(adapters and base, chunked prefill, preemption) give the CPU engine's tokens (which the CPU
suite checks against PEFT-merged models), with decode graphs on for the base rows (skipped
without CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.test_lora import CYCLE, lora_engine
from tests.engine.test_oracle import random_prompts, run_mix
from tests.lora_adapters import lora_adapters

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("scenario", ["roomy", "chunked+preemption"])
def test_lora_on_cuda_gives_the_cpu_engines_tokens(tiny_model, scenario):
    adapters = lora_adapters(tiny_model)
    n = 12
    rng = random.Random(3)
    prompts = random_prompts(3, n, max_len=40)
    max_tokens = [rng.randint(4, 16) for _ in range(n)]
    loras = [CYCLE[i % len(CYCLE)] for i in range(n)]
    cpu = lora_engine(tiny_model, scenario, adapters, max_loras=2)
    want = run_mix(cpu, prompts, max_tokens, [0] * n, loras)
    cuda = lora_engine(tiny_model, scenario, adapters, max_loras=2, device="cuda")
    assert [(c.part, c.result) for c in cuda.runner.self_check if c.part == "lora"] == [
        ("lora", "pass")
    ]
    assert cuda.runner.lora.kernel
    assert run_mix(cuda, prompts, max_tokens, [0] * n, loras) == want
