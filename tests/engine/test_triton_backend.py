"""The `triton` backend's kernels, run by Triton's interpreter on CPU tensors, against dense
attention: mixed steps (decodes, fresh prefill chunks, chunks resuming on cached prefixes),
scattered block tables, GQA ratios, head sizes and block sizes that are not powers of two."""

from __future__ import annotations

import os

import pytest
import torch

# NOTE: read when the kernels are defined, so before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tests.engine.test_attention_backend import _check_against_dense, make_case  # noqa: E402


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (4, 4, 64, 16),  # GQA ratio 1
        (8, 2, 128, 16),  # ratio 4
        (8, 1, 64, 16),  # ratio 8
        (16, 2, 128, 16),  # ratio 8 at the common head size
        (8, 1, 32, 4),
        (6, 2, 24, 3),  # head size and block size not powers of two
    ],
)
def test_triton_backend_matches_dense_attention_and_fills_the_cache(
    num_heads, num_kv_heads, head_dim, block_size
):
    shapes = [(0, 1), (5, 1), (37, 1), (0, 9), (11, 6), (2 * block_size, 20), (3, 70)]
    shapes.sort(key=lambda s: s[1] != 1)  # decodes first, as the runner orders them
    layout, q, k, v, k_cache, v_cache, contexts = make_case(
        11, num_heads, num_kv_heads, head_dim, block_size, shapes
    )
    _check_against_dense(TritonAttentionBackend(), layout, q, k, v, k_cache, v_cache, contexts)


@pytest.mark.parametrize("shapes", [[(9, 1), (40, 1), (16, 1)], [(0, 50), (33, 40)]])
def test_triton_backend_on_decode_only_and_prefill_only_steps(shapes):
    layout, q, k, v, k_cache, v_cache, contexts = make_case(2, 8, 2, 64, 16, shapes)
    _check_against_dense(TritonAttentionBackend(), layout, q, k, v, k_cache, v_cache, contexts)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_triton_backend_with_a_sliding_window(window):
    """Blocks wholly before a tile's window are skipped; keys inside them must not count."""
    shapes = [(3, 1), (70, 1), (0, 9), (0, 90), (11, 6), (45, 70)]
    layout, q, k, v, k_cache, v_cache, contexts = make_case(
        6, 8, 2, 64, 16, shapes, sliding_window=window
    )
    _check_against_dense(TritonAttentionBackend(), layout, q, k, v, k_cache, v_cache, contexts)


def test_triton_backend_with_sinks_on_windowed_and_full_layers():
    from tests.engine.test_attention_backend import sinks_and_windows_case

    sinks_and_windows_case(TritonAttentionBackend())


def test_triton_backend_reads_a_strided_query_view():
    """The decoder passes q as a view of a fused q/k/v tensor."""
    layout, q, k, v, k_cache, v_cache, contexts = make_case(
        3, 4, 2, 16, 16, [(4, 1), (0, 12), (20, 5)]
    )
    fused = torch.cat([q, torch.randn(q.shape[0], 2, 16)], 1)
    view = fused[:, :4]
    assert not view.is_contiguous()
    _check_against_dense(TritonAttentionBackend(), layout, view, k, v, k_cache, v_cache, contexts)


def test_the_engine_on_the_triton_backend_passes_the_oracle(tiny_model):
    """Chunked prefill, prefix-cache hits (shared prompt starts) and decodes in mixed steps,
    every request token-exact against transformers (float32)."""
    from tests.conftest import build_engine
    from tests.engine.oracle import HFOracle
    from tests.engine.test_oracle import check_against_oracle, random_prompts, run_mix

    engine = build_engine(
        tiny_model, 4, 80, attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=24
    )
    assert engine.runner.backend.name == "triton"
    prompts = random_prompts(5, 4, 30)
    prompts.append(prompts[0][:12] + prompts[1])  # resumes on a cached prefix
    max_tokens = [5, 3, 6, 4, 5]
    tokens = run_mix(engine, prompts, max_tokens, [0, 0, 1, 2, 3])
    check_against_oracle(HFOracle(tiny_model), prompts, max_tokens, tokens)


def test_a_sliding_window_model_on_the_triton_backend_passes_the_oracle():
    from tests.engine.test_oracle import check_sliding_window_model

    check_sliding_window_model("triton")


def test_triton_needs_cuda_outside_the_interpreter(monkeypatch):
    from engine.attention.registry import AttentionShape, get_attention_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend 'triton' \\(device\\): runs on CUDA"):
        get_attention_backend("triton", AttentionShape("cpu", "float32", 64, 16))
    with pytest.raises(ValueError, match="head_dim 512"):
        get_attention_backend("triton", AttentionShape("cuda", "bfloat16", 512, 16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_backend_in_half_precision_is_within_its_rounding(dtype):
    """float16 / bfloat16 caches and queries: the kernel accumulates in float32, so it is as
    close to the float32 result as rounding the inputs and the output allows."""
    layout, q, k, v, k_cache, v_cache, contexts = make_case(
        5, 8, 2, 64, 16, [(9, 1), (40, 1), (0, 33), (20, 7)]
    )
    half = [t.to(dtype) for t in (q, k, v, k_cache, v_cache)]
    backend = TritonAttentionBackend()
    scale = 64**-0.5
    out = backend.forward(*half, backend.prepare(layout), scale)
    assert out.dtype == dtype
    reference = TritonAttentionBackend().forward(
        *(t.to(dtype).float() for t in (q, k, v, k_cache, v_cache)), backend.prepare(layout), scale
    )
    tol = 1e-2 if dtype == torch.float16 else 4e-2
    torch.testing.assert_close(out.float(), reference, atol=tol, rtol=tol)
