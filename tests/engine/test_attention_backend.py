"""The attention backend contract, checked against dense per-request attention.

Both backends (`cpu`: the native decode and prefill kernels; `torch`: the reference) must
write the new K/V into the right cache slots and return causal attention over each request's
whole context. Every GPU backend will be held to this same test.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.nn.functional as F

from engine.attention.base import BatchLayout
from engine.attention.torch_backend import TorchAttentionBackend
from engine.cpu.attention_backend import CpuAttentionBackend
from engine.cpu.attention_kernels import load_native_decode, load_native_prefill


def dense_reference(q, k, v, scale, sliding_window=None, sinks=None):
    """q: [n, H, D] new queries at the end of a context of len(k) keys [L, Hkv, D]; with a
    window, each query sees the keys of its last `sliding_window` positions; with `sinks`
    [H], each head's softmax also holds its sink logit (as transformers' gpt-oss computes
    it)."""
    n, L = q.shape[0], k.shape[0]
    q_pos = torch.arange(L - n, L)
    mask = torch.arange(L)[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= torch.arange(L)[None, :] > q_pos[:, None] - sliding_window
    if sinks is not None:
        group = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        logits = torch.einsum("nhd,lhd->hnl", q, keys) * scale
        logits = logits.masked_fill(~mask, float("-inf"))
        logits = torch.cat([logits, sinks[:, None, None].expand(-1, n, 1)], -1)
        probs = torch.softmax(logits, -1)[..., :-1]
        return torch.einsum("hnl,lhd->nhd", probs, values)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def make_case(seed, num_heads, num_kv_heads, head_dim, block_size, shapes, sliding_window=None):
    """shapes: list of (tokens already cached, new tokens) per request, decodes first."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 4 + sum(-(-(c + n) // block_size) for c, n in shapes)
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks scattered over the cache, as after real traffic
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables, contexts, slots, offsets = [], [], [], [0]
    qs, ks, vs = [], [], []
    for cached, new in shapes:
        blocks = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        tables.append(blocks)
        flat_k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:cached].clone()
        flat_v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:cached].clone()
        k_new = torch.randn(new, num_kv_heads, head_dim, generator=gen)
        v_new = torch.randn(new, num_kv_heads, head_dim, generator=gen)
        contexts.append((torch.cat([flat_k, k_new]), torch.cat([flat_v, v_new])))
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen))
        ks.append(k_new)
        vs.append(v_new)
        for pos in range(cached, cached + new):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        offsets.append(offsets[-1] + new)
    width = max(len(t) for t in tables)
    layout = BatchLayout(
        num_decodes=sum(1 for _, n in shapes if n == 1),
        query_start_loc=offsets,
        num_computed=[c for c, _ in shapes],
        seq_lens=[c + n for c, n in shapes],
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        block_size=block_size,
        sliding_window=sliding_window,
    )
    return layout, torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, contexts


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 16, 4), (12, 4, 64, 16), (8, 8, 128, 8), (6, 2, 24, 3)],
)
def test_backend_matches_dense_attention_and_fills_the_cache(
    native, num_heads, num_kv_heads, head_dim, block_size
):
    if native and load_native_decode() is None:
        pytest.skip("no C compiler here")
    shapes = [(0, 1), (5, 1), (37, 1), (block_size, 1), (0, 9), (11, 6), (2 * block_size, 1 + 3)]
    shapes.sort(key=lambda s: s[1] != 1)  # decodes first, as the runner orders them
    layout, q, k, v, k_cache, v_cache, contexts = make_case(
        3, num_heads, num_kv_heads, head_dim, block_size, shapes
    )
    backend = CpuAttentionBackend() if native else TorchAttentionBackend()
    _check_against_dense(backend, layout, q, k, v, k_cache, v_cache, contexts)


def sinks_and_windows_case(backend) -> None:
    """gpt-oss's attention: sinks on every layer, and layers with and without the step's
    window, one after the other in one step (the metadata serves both kinds)."""
    shapes = [(3, 1), (40, 1), (0, 9), (0, 30), (11, 6), (25, 20)]
    layout, q, k, v, k_cache, v_cache, contexts = make_case(
        8, 8, 2, 32, 8, shapes, sliding_window=7
    )
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2
    for windowed in (True, False, True):
        _check_against_dense(backend, layout, q, k, v, k_cache, v_cache, contexts, sinks, windowed)


@pytest.mark.parametrize("native", [True, False])
def test_backend_with_sinks_on_windowed_and_full_layers(native):
    sinks_and_windows_case(CpuAttentionBackend() if native else TorchAttentionBackend())


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("window", [1, 7, 16])
def test_backend_with_a_sliding_window_sees_only_the_last_positions(native, window):
    """Decodes and prefill chunks (fresh ones longer than the window, ones resuming on a
    cached prefix) attend to the last `window` positions only; the cpu backend runs its
    reference path for them."""
    if native and load_native_decode() is None:
        pytest.skip("no C compiler here")
    shapes = [(3, 1), (40, 1), (0, 9), (0, 30), (11, 6), (25, 20)]
    layout, q, k, v, k_cache, v_cache, contexts = make_case(
        4, 8, 2, 32, 8, shapes, sliding_window=window
    )
    backend = CpuAttentionBackend() if native else TorchAttentionBackend()
    _check_against_dense(backend, layout, q, k, v, k_cache, v_cache, contexts)


def _check_against_dense(
    backend, layout, q, k, v, k_cache, v_cache, contexts, sinks=None, windowed=True
):
    scale = q.shape[-1] ** -0.5
    metadata = backend.prepare(layout)
    out = backend.forward(
        q, k, v, k_cache, v_cache, metadata, scale, sinks=sinks, windowed=windowed
    )
    window = layout.sliding_window if windowed else None
    for i, (ctx_k, ctx_v) in enumerate(contexts):
        start, end = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        want = dense_reference(q[start:end], ctx_k, ctx_v, scale, window, sinks)
        torch.testing.assert_close(out[start:end], want, atol=2e-5, rtol=1e-4)
    flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    torch.testing.assert_close(flat_k[layout.slot_mapping], k)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(12, 4, 64, 16), (8, 1, 32, 16), (8, 8, 128, 8), (6, 2, 48, 5)],
)
def test_native_prefill_on_long_chunks(num_heads, num_kv_heads, head_dim, block_size):
    """Chunks longer than one task's rows and one softmax step (tiles split across tasks,
    partial tiles, keys past a step's end), fresh and after a cached prefix, with q a strided
    view of a fused q/k tensor as the decoder passes it."""
    if load_native_prefill() is None:
        pytest.skip("no C compiler or no AVX2 + FMA here")
    shapes = [(0, 1), (70, 1), (0, 333), (200, 130), (0, 65), (31, 97)]
    layout, q, k, v, k_cache, v_cache, contexts = make_case(
        5, num_heads, num_kv_heads, head_dim, block_size, shapes
    )
    fused = torch.cat([q, torch.randn(q.shape[0], num_kv_heads, head_dim)], 1)
    q_view = fused[:, :num_heads]
    assert not q_view.is_contiguous()
    backend = CpuAttentionBackend()
    _check_against_dense(backend, layout, q_view, k, v, k_cache, v_cache, contexts)


def test_avx2_and_avx512_prefill_kernels_give_the_same_numbers():
    """On an AVX-512 host, the AVX2 build of the prefill kernel (compiled here with
    -mno-avx512f) and the AVX-512 build agree bit for bit: a request's numbers do not depend
    on which of the two ISAs its host has."""
    import ctypes

    from engine.cpu.attention_kernels import PrefillChunks, paged_prefill_attention
    from engine.cpu.build import host_cpu_flags

    if "avx512f" not in host_cpu_flags() or load_native_prefill() is None:
        pytest.skip("needs an AVX-512 host and a C compiler")
    avx2 = load_native_prefill(("-mno-avx512f",))
    assert avx2 is not None and avx2 is not load_native_prefill()
    num_heads, num_kv_heads, head_dim, block_size = 12, 4, 48, 16
    shapes = [(0, 333), (200, 130), (0, 17), (31, 97)]
    layout, q, k, v, k_cache, v_cache, _ = make_case(
        7, num_heads, num_kv_heads, head_dim, block_size, shapes
    )
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    flat_k[layout.slot_mapping], flat_v[layout.slot_mapping] = k, v
    starts = torch.tensor(layout.query_start_loc[:-1], dtype=torch.int64)
    chunks = PrefillChunks(
        starts,
        torch.tensor([n for _, n in shapes], dtype=torch.int64),
        torch.tensor(layout.num_computed, dtype=torch.int64),
        layout.block_table.to(torch.int64).contiguous(),
    )
    outs = []
    for lib in (load_native_prefill(), avx2):
        assert isinstance(lib, ctypes.CDLL)
        out = torch.zeros_like(q)
        assert paged_prefill_attention(lib, q, k_cache, v_cache, chunks, out, head_dim**-0.5)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert outs[0].abs().sum() > 0


def test_auto_picks_per_device_and_dtype_and_says_why():
    from engine.attention.registry import AttentionShape, get_attention_backend

    def pick(name, device, dtype, head_dim=64):
        backend, reason = get_attention_backend(name, AttentionShape(device, dtype, head_dim, 16))
        return backend.name, reason

    native = load_native_decode() is not None
    assert pick("auto", "cpu", "float32")[0] == ("cpu" if native else "torch")
    name, reason = pick("auto", "cpu", "bfloat16")
    assert name == "torch" and "float32" in reason
    assert pick("torch", "cpu", "float32") == ("torch", "set in the configuration")
    # CUDA (decided from the device name: no GPU needed): flashinfer where installed, else
    # our triton kernel; each fallback says what ruled the faster one out.
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    has_triton = importlib.util.find_spec("triton") is not None
    name, reason = pick("auto", "cuda", "bfloat16")
    if has_flashinfer:
        assert name == "flashinfer"
    else:
        assert name == ("triton" if has_triton else "torch")
        assert "flashinfer-python is not installed" in reason
    if has_triton:  # flashinfer takes no float32 and no head size 96: triton does
        assert pick("auto", "cuda", "float32")[0] == "triton"
        assert pick("auto", "cuda", "bfloat16", head_dim=96)[0] == "triton"


@pytest.mark.parametrize(
    ("name", "device", "dtype", "head_dim", "field"),
    [
        ("cpu", "cuda", "float32", 64, "device"),
        ("cpu", "cpu", "bfloat16", 64, "dtype"),
        ("flashinfer", "cpu", "bfloat16", 64, "device"),
        ("flash", "cuda", "float32", 64, "attention_backend"),
    ],
)
def test_a_backend_that_cannot_run_the_shape_is_refused_at_start(
    name, device, dtype, head_dim, field
):
    from engine.attention.registry import AttentionShape, get_attention_backend
    from engine.core.errors import InvalidParam

    with pytest.raises(InvalidParam) as err:
        get_attention_backend(name, AttentionShape(device, dtype, head_dim, 16))
    assert err.value.param == field
    assert "attention_backend" in str(err.value)


def test_the_engine_refuses_a_backend_before_loading_weights(tiny_model):
    """The cpu kernels run float32 only: asking for them in bfloat16 fails at start."""
    from tests.conftest import build_engine

    with pytest.raises(ValueError, match="dtype"):
        build_engine(tiny_model, attention_backend="cpu", dtype="bfloat16")
