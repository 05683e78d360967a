"""The fused native decoder ops compute what the torch path computes (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.build import host_cpu_vendor
from engine.cpu.decoder_ops import (
    DecoderOps,
    argmax_last_dim,
    load_gemm,
    native_gemm_token_limit,
)
from engine.cpu.packed_weights import PackedLinear, PackedWeight
from engine.model.decoder import RMSNorm
from engine.model.loader import read_spec
from engine.model.rope import RotaryEmbedding
from engine.model.weight_loader import load_decoder
from tests.conftest import tiny_model_dir

NATIVE = DecoderOps(native=True)
TORCH = DecoderOps(native=False)
pytestmark = pytest.mark.skipif(
    not NATIVE.applies(torch.empty(0)), reason="no C compiler: native ops unavailable"
)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_updates_the_residual_and_normalizes(rows: int, with_delta: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.rand(96, generator=gen) + 0.5
    h = torch.randn(rows, 96, generator=gen)
    delta = torch.randn(rows, 96, generator=gen) if with_delta else None
    h_native, h_torch = h.clone(), h.clone()
    out_native = NATIVE.add_rms_norm(h_native, delta, norm)
    with torch.inference_mode():
        out_torch = TORCH.add_rms_norm(h_torch, delta, norm)
    torch.testing.assert_close(h_native, h_torch, rtol=0, atol=0)  # the add is exact
    torch.testing.assert_close(out_native, out_torch, rtol=1e-6, atol=1e-6)
    if not with_delta:
        torch.testing.assert_close(h_native, h)


def test_silu_mul_matches_torch() -> None:
    gate_up = torch.randn(33, 2 * 80, generator=torch.Generator().manual_seed(1)) * 4
    expected = TORCH.silu_mul(gate_up.clone())
    got = NATIVE.silu_mul(gate_up)
    assert got.shape == (33, 80)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_matches_torch_on_a_strided_qk_view(head_dim: int) -> None:
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, t = 4, 2, 9
    # As the decoder holds it: q and k rows inside the fused qkv output, v after them.
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.tensor([0, 1, 2, 100, 101, 7, 511, 3, 4])
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(t, -1, head_dim)
    expected = TORCH.rotary(rope, positions, torch.float32)(qk.clone())
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    got = NATIVE.rotary(rope, positions, torch.float32)(qk)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # same products, same rounding
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("with_delta", [True, False])
def test_feature_major_add_rms_norm_is_the_transpose_of_the_row_op(
    tokens: int, with_delta: bool
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.rand(96, generator=gen) + 0.5
    h = torch.randn(tokens, 96, generator=gen)
    delta = torch.randn(tokens, 96, generator=gen) if with_delta else None
    h_rows, h_cols = h.clone(), h.t().contiguous()
    out_rows = NATIVE.add_rms_norm(h_rows, delta, norm)
    delta_cols = None if delta is None else delta.t().contiguous()
    out_cols = NATIVE.add_rms_norm_fm(h_cols, delta_cols, norm)
    assert out_cols.shape == (96, tokens)
    torch.testing.assert_close(h_cols.t(), h_rows, rtol=0, atol=0)  # the add is exact
    torch.testing.assert_close(out_cols.t(), out_rows, rtol=1e-6, atol=1e-6)


def test_feature_major_silu_mul_is_the_transpose_of_the_row_op() -> None:
    gate_up = torch.randn(33, 2 * 80, generator=torch.Generator().manual_seed(2)) * 4
    expected = NATIVE.silu_mul(gate_up)
    got = NATIVE.silu_mul_fm(gate_up.t().contiguous())
    assert got.shape == (80, 33)
    torch.testing.assert_close(got.t(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 200])
def test_argmax_of_a_transposed_view_matches_torch_with_ties(rows: int) -> None:
    columns = torch.randn(5000, rows, generator=torch.Generator().manual_seed(rows))
    columns[4000, 0] = columns[100, 0] = 50.0  # a tie: the first index wins, as in torch
    columns[4999, rows - 1] = 60.0  # the very last row of the last band
    logits = columns.t()  # what the feature-major decoder returns
    got = argmax_last_dim(logits)
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got[0] == (100 if rows > 1 else 4999)
    contiguous = logits.contiguous()
    assert argmax_last_dim(contiguous).tolist() == got.tolist()  # the torch path


_GEMM_SHAPES = [
    # (out features, in features, tokens): row tails of the 6-, 8- and 16-row tiles, column
    # tails of the 16- and 32-column panels (AVX-512: the GEMV up to 8 tokens, the narrow
    # tile up to 16, the wide one from 17), one token, odd and long K (several K slices; the
    # GEMV's last partial 16 x 16 piece), a vocab projection, several chunks of panels (a
    # prefill step), row blocks that the threads' grains do not divide evenly.
    (1280, 768, 37),
    (768, 2048, 160),
    (4096, 768, 1),
    (13, 7, 5),
    (6, 1001, 16),
    (21, 300, 17),
    (16384, 768, 64),
    (5, 3000, 151),
    (29, 2500, 700),
    (1000, 300, 300),
    (37, 100, 3),
    (20, 9000, 2),
]


@pytest.mark.skipif(not NATIVE._gemm, reason="native GEMM: AVX2 + FMA or AVX-512 hosts")
@pytest.mark.parametrize(("n", "k", "t"), _GEMM_SHAPES)
@pytest.mark.parametrize("token_major", [False, True])
def test_native_feature_major_gemm_matches_torch(n: int, k: int, t: int, token_major) -> None:
    """x feature-major, or the transposed view of a token-major [t, k] tensor (attention's
    output, which the kernel packs without a copy first)."""
    torch.manual_seed(n + k + t)
    weight = torch.randn(n, k)
    x = torch.randn(t, k).t() if token_major else torch.randn(k, t)
    out = NATIVE.mm_fm(weight, x)
    ref = torch.mm(weight.double(), x.double()).float()
    assert out.shape == (n, t)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * k**0.5)


@pytest.mark.skipif(not NATIVE._gemm, reason="native GEMM: AVX2 + FMA or AVX-512 hosts")
def test_native_gemm_gives_each_token_the_same_numbers_whatever_the_batch() -> None:
    """Each output column is one sequential sum over k: a request's result does not depend
    on its batch (the oracle's premise, and what makes greedy outputs batch-invariant)."""
    torch.manual_seed(0)
    ops = NATIVE
    # Wider steps go to MKL where this host's build stops short of them (AVX2: 160 tokens).
    width = min(300, ops.gemm_fm_max_tokens)
    weight, x = torch.randn(1280, 768), torch.randn(768, width)
    whole = ops.mm_fm(weight, x)
    # Widths past a multiple of 32 by 1-8 take a GEMV tail panel, by 9-16 a narrow one, by
    # 17-24 both, by 25-31 a padded wide one (17-31 tokens alone too); both weight layouts.
    # Up to 8 tokens alone each build's GEMV (1, 2, 4 and 8 columns at once, and between).
    slices = (
        (0, 1),
        (5, 7),
        (9, 12),
        (60, 64),
        (20, 27),
        (40, 48),
        (3, 20),
        (17, 150),
        (150, 300),
        (0, 33),
        (7, 47),
        (1, 49),
        (0, 54),
        (0, 97),
        (2, 30),
    )
    layouts = (weight, PackedWeight(weight)) if ops.packs_weights else (weight,)
    for w in layouts:
        for lo, hi in slices:
            hi = min(hi, width)
            assert torch.equal(ops.mm_fm(w, x[:, lo:hi]), whole[:, lo:hi]), (lo, hi)
    # A non-contiguous (transposed) activation and a transposed result view are accepted.
    assert torch.equal(ops.mm_fm(weight, x.t().contiguous().t()), whole)


@pytest.mark.parametrize(("n", "k", "t"), [*_GEMM_SHAPES, (40, 64, 8), (1280, 768, 12)])
@pytest.mark.parametrize("token_major", [False, True])
def test_packed_weights_give_the_row_major_numbers(n: int, k: int, t: int, token_major) -> None:
    """The W16 layout (blocks of 16 rows stored [K][16]; rows past N zero) changes where
    the kernels read W, not the FMAs: bit-identical products for every tile and the GEMV,
    row tails included. Without the AVX-512 build it takes torch on the unpacked weight."""
    torch.manual_seed(n * k + t)
    weight = torch.randn(n, k)
    x = torch.randn(t, k).t() if token_major else torch.randn(k, t)
    packed = PackedWeight(weight)
    assert packed.shape == (n, k) and packed.data.shape == (-(-n // 16), k, 16)
    assert torch.equal(packed.unpacked(), weight)
    out = NATIVE.mm_fm(packed, x)
    if NATIVE.packs_weights:
        assert torch.equal(out, NATIVE.mm_fm(weight, x))
    else:
        torch.testing.assert_close(out, torch.mm(weight, x), rtol=1e-4, atol=1e-4 * k**0.5)


def test_decoder_packs_its_gemm_weights_where_the_native_gemm_runs_every_step() -> None:
    """`pack_weights` swaps each GEMM-only Linear for a PackedLinear (the tied LM head, also
    the embedding, stays row-major); `unpack_weights` gives back the same weights, and the
    token-major forward of a PackedLinear computes what the Linear did."""
    model_dir = tiny_model_dir("qwen2")  # tied embeddings, qkv bias
    spec = read_spec(model_dir)
    decoder = load_decoder(model_dir, spec, torch.device("cpu"), torch.float32)
    before = {name: p.clone() for name, p in decoder.state_dict().items()}
    qkv = decoder.layers[0].self_attn.qkv_proj
    x = torch.randn(5, qkv.in_features)
    expected = qkv(x)
    decoder.pack_weights()
    packed = decoder.layers[0].self_attn.qkv_proj
    if not decoder.ops.packs_weights:
        assert packed is qkv
        return
    assert isinstance(packed, PackedLinear) and packed.bias is not None
    assert torch.equal(packed(x), expected)
    assert isinstance(decoder.layers[-1].mlp.down_proj, PackedLinear)
    assert isinstance(decoder.lm_head, torch.nn.Linear)  # tied to embed_tokens
    decoder.unpack_weights()
    after = decoder.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)


@pytest.mark.skipif(not NATIVE.packs_weights, reason="needs the AVX-512 build (its host)")
@pytest.mark.parametrize(("n", "k", "t"), _GEMM_SHAPES[:8])
def test_avx2_and_avx512_gemm_builds_give_the_same_numbers(n: int, k: int, t: int) -> None:
    """The AVX2 build (compiled here with -mno-avx512f: what an AVX2-only host runs) keeps
    building, gives the AVX-512 build's numbers bit for bit, and has no W16 kernels."""
    avx2 = load_gemm(("-mno-avx512f",))
    assert avx2 is not None and avx2.gemm_fm_isa() == 2
    torch.manual_seed(n + k + t)
    weight, x = torch.randn(n, k), torch.randn(k, t)
    out = torch.empty(n, t)
    assert avx2.gemm_fm(weight.data_ptr(), x.data_ptr(), out.data_ptr(), n, k, t, 0, 2) == 0
    assert torch.equal(out, NATIVE.mm_fm(weight, x))
    packed = PackedWeight(weight)
    assert avx2.gemm_fm_w16(packed.data.data_ptr(), x.data_ptr(), out.data_ptr(), n, k, t, 0, 2)


def test_gemm_past_the_token_limit_and_empty_batches_take_torch() -> None:
    ops = NATIVE
    weight = torch.randn(64, 32)
    # The AVX2 build stops at 160 tokens; the AVX-512 build has no limit.
    for t in (0, ops.gemm_fm_max_tokens + 1) if ops.gemm_fm_max_tokens < 4096 else (0,):
        x = torch.randn(32, t)
        torch.testing.assert_close(ops.mm_fm(weight, x), torch.mm(weight, x))


def test_which_hosts_run_the_native_gemm() -> None:
    """AVX2 hosts up to 160 tokens; AVX-512 only on AMD CPUs, where MKL keeps to AVX2
    kernels (every size); Intel's AVX-512 MKL and builds without either ISA: never."""
    assert native_gemm_token_limit(2, "AuthenticAMD") == 160
    assert native_gemm_token_limit(2, "GenuineIntel") == 160
    assert native_gemm_token_limit(512, "AuthenticAMD") >= 1 << 20
    assert native_gemm_token_limit(512, "GenuineIntel") == 0
    assert native_gemm_token_limit(0, "AuthenticAMD") == 0
    # This host: the limit DecoderOps took is the one its CPU and build call for.
    ops = DecoderOps()
    if ops._gemm is not None:
        assert ops.gemm_fm_max_tokens == native_gemm_token_limit(
            ops._gemm.gemm_fm_isa(), host_cpu_vendor()
        )


@pytest.mark.parametrize(("rows", "cols"), [(1792, 300), (13, 37), (1, 5), (7, 1), (768, 2048)])
def test_transposed_copies_exactly(rows: int, cols: int) -> None:
    """Feature-major <-> token-major: the native register transpose (AVX-512 builds; tails
    of 16-row strips and 16-column pieces) or torch's copy, the same values either way."""
    x = torch.randn(rows, cols)
    out = NATIVE.transposed(x)
    assert out.is_contiguous() and out.shape == (cols, rows)
    assert torch.equal(out, x.t())
    # A view that is not contiguous takes torch's copy.
    assert torch.equal(NATIVE.transposed(x.t()), x)


def test_transposed_is_native_on_avx512_builds() -> None:
    ops = DecoderOps()
    if ops._gemm is not None and ops._gemm.gemm_fm_isa() == 512:
        assert ops._transpose is not None
