"""Every CUDA attention backend against dense attention on random paged batches (scattered
block tables, GQA ratios 1/4/8, head sizes 64/128/256, decodes, fresh and resumed prefill
chunks, sliding windows), in the half-precision dtypes they serve in; and the engine on each,
serving in bfloat16 (skipped without CUDA; flashinfer also without flashinfer-python)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.attention.registry import AttentionShape, get_attention_backend
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.tiny_model import make_model
from tests.conftest import REPO
from tests.engine.test_attention_backend import dense_reference, make_case
from tests.gpu.test_cuda_engine import check_half_precision_serving

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA_BACKENDS = [
    "triton",
    pytest.param(
        "flashinfer",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("flashinfer") is None, reason="flashinfer-python not installed"
        ),
    ),
]


@pytest.mark.parametrize("backend_name", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window"),
    [(8, 8, 64, None), (32, 8, 128, None), (32, 4, 128, 40), (16, 2, 256, None), (8, 1, 64, 7)],
)
def test_cuda_backend_matches_dense_attention(
    backend_name, dtype, num_heads, num_kv_heads, head_dim, window
):
    shape = AttentionShape("cuda", str(dtype).removeprefix("torch."), head_dim, 16)
    backend, _ = get_attention_backend(backend_name, shape)
    shapes = [(0, 1), (17, 1), (300, 1), (0, 90), (64, 33), (200, 129)]
    layout, q, k, v, k_cache, v_cache, contexts = make_case(
        9, num_heads, num_kv_heads, head_dim, 16, shapes, sliding_window=window
    )
    cuda = [t.to("cuda", dtype) for t in (q, k, v, k_cache, v_cache)]
    layout.block_table = layout.block_table.cuda()
    layout.slot_mapping = layout.slot_mapping.cuda()
    scale = head_dim**-0.5
    out = backend.forward(*cuda, backend.prepare(layout), scale).float().cpu()
    for i, (ctx_k, ctx_v) in enumerate(contexts):
        start, end = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        rounded = [t.to(dtype).float() for t in (q[start:end], ctx_k, ctx_v)]
        want = dense_reference(*rounded, scale, window)
        torch.testing.assert_close(out[start:end], want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend_name", CUDA_BACKENDS)
def test_the_engine_serves_bfloat16_on_each_cuda_backend(backend_name):
    """bfloat16 tokens may differ from float32 HF: every request gets its tokens, the first
    ones mostly agree with HF, and no block leaks (a head size-64 model: FlashInfer's
    smallest)."""
    model = str(make_model(REPO / "models" / "tiny-hd64", size="tiny-hd64"))
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cuda",
            dtype="bfloat16",
            attention_backend=backend_name,
            cache=CacheConfig(block_size=16, kv_cache_bytes=1 << 28),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
        )
    )
    assert engine.runner.backend.name == backend_name
    check_half_precision_serving(engine, model)
