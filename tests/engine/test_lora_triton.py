"""LoRA's Triton kernels (engine/lora/triton_kernels.py) under Triton's interpreter: the
segmented shrink and expand equal each token's own x A^T B^T, and an engine running them
gives the PEFT-merged model's greedy tokens."""

from __future__ import annotations

import os

import pytest
import torch

# NOTE: read when the kernels are defined, so before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.lora.layer_lora import LayerLoRA  # noqa: E402
from engine.lora.segments import LoRAStep  # noqa: E402
from engine.lora.triton_kernels import KernelSegments  # noqa: E402
from tests.engine.oracle import HFOracle  # noqa: E402
from tests.engine.test_lora import CYCLE, check_mix, lora_engine  # noqa: E402
from tests.engine.test_lora_segments import IN, PARTS, layout, reference, weights  # noqa: E402
from tests.engine.test_oracle import random_prompts, run_mix  # noqa: E402
from tests.lora_adapters import lora_adapters  # noqa: E402


@pytest.mark.parametrize("dim", [0, 1])
def test_kernels_give_each_tokens_own_delta(dim):
    gen = torch.Generator().manual_seed(7 + dim)
    a, bs = weights(gen)
    lengths = [(2, 3), (-1, 2), (0, 21), (5, 1), (3, 17)]  # tiles of 16 tokens, and runs past
    slot_of_token, segments = layout(lengths)
    kernel = KernelSegments(segments, torch.device("cpu"))
    step = LoRAStep(True, kernel=kernel, parts={name for name, _, _ in bs})
    x = torch.randn(len(slot_of_token), IN, generator=gen)
    base = torch.randn(len(slot_of_token), sum(PARTS), generator=gen)
    out = base.clone() if dim == 0 else base.t().contiguous()
    LayerLoRA(step, {"m": (a, bs)}).add("m", out, x if dim == 0 else x.t().contiguous(), dim)
    got = out if dim == 0 else out.t()
    torch.testing.assert_close(got, base + reference(a, bs, x, slot_of_token), rtol=1e-4, atol=1e-4)


def test_an_engine_on_the_kernels_matches_peft_merged(tiny_model):
    adapters = lora_adapters(tiny_model)
    engine = lora_engine(tiny_model, "chunked+preemption", adapters, max_loras=2)
    engine.runner.lora.kernel = True
    n = 4
    prompts = random_prompts(11, n, max_len=20)
    loras = [CYCLE[i % len(CYCLE)] for i in range(n)]
    tokens = run_mix(engine, prompts, [4] * n, [0] * n, loras)
    oracles = {
        None: HFOracle(tiny_model),
        **{k: HFOracle(tiny_model, p) for k, p in adapters.items()},
    }
    check_mix(oracles, prompts, [4] * n, loras, tokens)
