"""The engine on a CUDA device still matches HF greedy decoding (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import random_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_greedy_tokens_match_hf_on_cuda(tiny_model):
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model,
            device="cuda",
            cache=CacheConfig(block_size=16, gpu_memory_fraction=0.2),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
        )
    )
    oracle = HFOracle(tiny_model)
    prompts = random_prompts(5, 12, max_len=60)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = engine.generate(prompts, params)
    verdicts = [oracle.compare(p, r.token_ids, 20) for p, r in zip(prompts, results, strict=True)]
    assert verdicts.count("near-tie") <= 1
