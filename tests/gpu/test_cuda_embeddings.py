"""Embedding requests on a CUDA device (skipped without CUDA): pooled final hidden states
(last token and mean across chunks) within 1e-4 of transformers' in float32, beside
generating requests that run in decode graphs and launch steps ahead, with both attention
backends; every block comes back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from engine.core.sampling_params import SamplingParams
from tests.conftest import build_engine
from tests.engine.test_embeddings import PROMPTS, embed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers_on_cuda(tiny_model, backend, pooling):
    if backend == "triton":
        pytest.importorskip("triton")
    model = AutoModel.from_pretrained(tiny_model, dtype=torch.float32).eval()
    engine = build_engine(
        tiny_model, device="cuda", attention_backend=backend, max_num_batched_tokens=16
    )
    params = SamplingParams(max_tokens=1, pooling=pooling)
    vectors, _ = embed(engine, PROMPTS, params, PROMPTS[:2], max_tokens=24)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
        want = F.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)
        assert torch.allclose(vectors[f"e{i}"], want, atol=1e-4, rtol=0), (i, pooling)
