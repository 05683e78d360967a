"""On CUDA sampled rows are drawn by one kernel without a sort (skipped without CUDA): at a
Llama-3 vocabulary it keeps exactly what the sorted definition keeps, in bfloat16 (ties) and
float32, and draws the tokens the definition draws, and the CPU's sampler."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.sampling.sampler import Sampler
from engine.sampling.token_draw import columns, draw_by_sort, thresholds_by_sort
from engine.sampling.token_draw_kernel import draw

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

VOCAB = 128256
PARAMS = [
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=50),
    SamplingParams(temperature=1.0, top_k=1000, top_p=0.95, min_p=0.01),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=1.0, top_p=1e-6),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_keeps_and_draws_what_the_sort_does(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = 64
    logits = torch.randn(rows, VOCAB, generator=g, device="cuda").mul_(3).to(dtype).float()
    params = [PARAMS[i % len(PARAMS)] for i in range(rows)]
    temperature, *filters = columns(params, VOCAB, logits.device)
    u = torch.rand(rows, generator=g, device="cuda")
    tokens, searched = draw(logits, temperature, *filters, u)
    scaled = logits / temperature[:, None]
    defined = thresholds_by_sort(scaled, *filters)
    by_sort = draw_by_sort(logits, params, u)
    for row in range(rows):
        x, a, b = scaled[row], searched[row].item(), defined[row].item()
        assert x[tokens[row]] >= a  # the drawn token is one the row keeps
        if (x >= a).equal(x >= b):
            assert tokens[row] == by_sort[row], row
        else:
            # Top-p sums a 128k vocabulary in another order than the sort's cumsum: the two
            # may then disagree by one value at the boundary, never by more.
            low, high = min(a, b), max(a, b)
            assert params[row].top_p < 1.0 and not ((x > low) & (x < high)).any(), row


def test_seeded_draws_on_cuda_equal_the_cpus():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS) * 8, VOCAB, generator=g) * 3
    rows = [
        ScheduledRequest(str(i), [1], 5, [0], True, replace(params, seed=i), 4)
        for i, params in enumerate(PARAMS * 8)
    ]
    on_cpu = Sampler(0).sample(logits.clone(), rows)
    on_cuda = Sampler(0).sample(logits.cuda(), rows)
    assert on_cuda == on_cpu
