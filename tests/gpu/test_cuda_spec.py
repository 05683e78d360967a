"""Speculative decoding on CUDA: with each attention backend and decode graphs on (rows with
drafts run eagerly, the rest replay), ngram and draft-model speculation change no output
against the same engine without it (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.model.truncated_draft import make_truncated_draft
from tests.conftest import build_engine
from tests.engine.test_speculative_decoding import greedy, repetitive_prompts, run, sampled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_on_cuda_changes_no_token(tiny_model, tmp_path, backend, method):
    prompts = repetitive_prompts(29, 8)
    params = greedy([24] * 4) + sampled(4, seed=29)
    settings = {"method": method, "adaptive": False}
    if method == "draft_model":
        settings["model"] = str(make_truncated_draft(tiny_model, 2, tmp_path / "draft"))
    common = {"device": "cuda", "attention_backend": backend, "max_num_seqs": 8}
    plain = run(build_engine(tiny_model, **common), prompts, params)
    engine = build_engine(tiny_model, speculative=settings, **common)
    assert run(engine, prompts, params) == plain
    assert engine.stats().spec.num_draft_tokens > 0
