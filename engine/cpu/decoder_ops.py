"""The decoder's elementwise steps: fused native kernels on CPU float32, torch elsewhere.

On CPU a prefill chunk's activations are tens of MB and each torch op is one more pass over
them; `csrc/fused_ops.c` does residual add + RMSNorm, SiLU * up and RoPE in one pass each.
Other devices and dtypes keep the torch path. The `_fm` twins work on feature-major activations
([features, tokens], the decoder's layout for decode steps), and `argmax_last_dim` does greedy
sampling from the logits that layout returns.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.cpu.build import host_cpu_vendor, load_native
from engine.cpu.packed_weights import PackedWeight
from engine.model.rope import RotaryEmbedding, apply_rope

_SOURCE = Path(__file__).with_name("csrc") / "fused_ops.c"
_GEMM_SOURCE = Path(__file__).with_name("csrc") / "gemm_fm.c"
# Up to this many tokens the native GEMM's AVX2 build beats MKL (docs/cpu-kernels.md).
GEMM_FM_MAX_TOKENS_AVX2 = 160


def native_gemm_token_limit(isa: int, vendor: str) -> int:
    """Steps of at most this many tokens use the native GEMM built for `isa` (2: AVX2 + FMA,
    512: AVX-512, 0: none) on a CPU of `vendor`; 0: never. On AMD CPUs MKL keeps to its AVX2
    kernels, and the AVX-512 build beats it at every size; on other AVX-512 CPUs MKL has
    512-bit kernels that ours was never compared with, so MKL keeps those."""
    if isa == 2:
        return GEMM_FM_MAX_TOKENS_AVX2
    if isa == 512 and vendor == "AuthenticAMD":
        return 1 << 30
    return 0


_MAX_HEAD_DIM = 512  # the rope kernel's per-row scratch

_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def _load() -> ctypes.CDLL | None:
    # NOTE: no FMA contraction, so each product rounds as torch's separate mul/add do.
    lib = load_native(_SOURCE, ("-ffp-contract=off",))
    if lib is not None:
        lib.add_rms_norm.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _float, _int]
        lib.silu_mul.argtypes = [_ptr, _ptr, _i64, _i64, _int]
        lib.rope_inplace.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _int, _int, _int]
        lib.add_rms_norm_fm.argtypes = lib.add_rms_norm.argtypes
        lib.silu_mul_fm.argtypes = lib.silu_mul.argtypes
        lib.argmax_columns.argtypes = [_ptr, _i64, _i64, _ptr, _int]
        fns = (lib.add_rms_norm, lib.silu_mul, lib.rope_inplace, lib.add_rms_norm_fm)
        for fn in (*fns, lib.silu_mul_fm, lib.argmax_columns):
            fn.restype = None
    return lib


@functools.cache
def load_gemm(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The feature-major GEMM (AVX2 + FMA or AVX-512 build), or None where it does not apply
    (no compiler, neither ISA). `extra_flags` (compiler flags) give A/B builds."""
    lib = load_native(_GEMM_SOURCE, extra_flags)
    if lib is None or not lib.gemm_fm_isa():
        return None
    for gemm in (lib.gemm_fm, lib.gemm_fm_w16):
        gemm.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int]
        gemm.restype = _int
    lib.transpose_fm.argtypes = [_ptr, _i64, _i64, _ptr, _int]
    lib.transpose_fm.restype = _int
    return lib


def _row_major(weight: torch.Tensor | PackedWeight) -> torch.Tensor:
    return weight.unpacked() if isinstance(weight, PackedWeight) else weight


class DecoderOps:
    """`native=False` (or no compiler) always takes the torch path."""

    def __init__(self, native: bool = True) -> None:
        self._lib = _load() if native else None
        self._gemm = load_gemm() if native else None
        # Steps of at most this many tokens use the native GEMM where it loads; 0: never.
        isa = self._gemm.gemm_fm_isa() if self._gemm else 0
        # The register transpose comes with the AVX-512 build, whoever's CPU (MKL plays no
        # part in it).
        self._transpose = self._gemm if isa == 512 else None
        self.gemm_fm_max_tokens = native_gemm_token_limit(isa, host_cpu_vendor())
        if not self.gemm_fm_max_tokens:
            self._gemm = None  # built, but MKL is the better choice on this CPU
        # Tokens per panel the native GEMM streams the weights once for (its tile's NR): a
        # step costs by whole panels (speculation's step-time model reads it). 1: unknown.
        self.token_panel = {2: 16, 512: 32}.get(isa, 1) if self._gemm else 1
        # Weights go to the W16 layout where the AVX-512 build runs every GEMM, so nothing
        # needs the row-major copy (the AVX2 build leaves large steps to MKL).
        self.packs_weights = self._gemm is not None and isa == 512

    def mm_fm(self, weight: torch.Tensor | PackedWeight, x: torch.Tensor) -> torch.Tensor:
        """`weight @ x` for feature-major x ([in_features, T]) -> [out_features, T]; only
        where `applies(x)`."""
        n, k = weight.shape
        t = x.shape[1]
        packed = isinstance(weight, PackedWeight)
        if (
            self._gemm is None
            or not 0 < t <= self.gemm_fm_max_tokens
            or n * k == 0
            or not (packed or weight.is_contiguous())
        ):
            return torch.mm(_row_major(weight), x)
        # A transposed token-major x (attention's output) is read as is: packing transposes.
        transposed = not x.is_contiguous() and x.t().is_contiguous()
        if not transposed:
            x = x.contiguous()
        out = x.new_empty(n, t)
        threads = torch.get_num_threads()
        gemm = self._gemm.gemm_fm_w16 if packed else self._gemm.gemm_fm
        w = weight.data if packed else weight
        if gemm(w.data_ptr(), x.data_ptr(), out.data_ptr(), n, k, t, int(transposed), threads):
            # The kernel could not allocate its packing buffer (or has no W16 build).
            return torch.mm(_row_major(weight), x)
        return out

    def transposed(self, x: torch.Tensor) -> torch.Tensor:
        """`x.t().contiguous()` for 2-D x: between the feature-major and token-major layouts
        (the native copy where built, ~5x torch's on a prefill step's q/k/v)."""
        if (
            self._transpose is None
            or not self.applies(x)
            or x.dim() != 2
            or not x.is_contiguous()
            or x.numel() == 0
        ):
            return x.t().contiguous()
        rows, cols = x.shape
        out = x.new_empty(cols, rows)
        if self._transpose.transpose_fm(
            x.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads()
        ):
            return x.t().contiguous()  # not this build's (it has no other failure)
        return out

    def applies(self, x: torch.Tensor) -> bool:
        return self._lib is not None and x.device.type == "cpu" and x.dtype == torch.float32

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module
    ) -> torch.Tensor:
        """`h += delta` in place (skipped for None), then return `norm(h)` as a new tensor."""
        if not (self.applies(h) and h.is_contiguous()):
            if delta is not None:
                h += delta
            return norm(h)
        t, hidden = h.shape
        return self._native_add_rms_norm(self._lib.add_rms_norm, h, delta, norm, t, hidden)

    def add_rms_norm_fm(
        self, h: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module
    ) -> torch.Tensor:
        """`add_rms_norm` for feature-major h and delta ([hidden, T]); only where
        `applies(h)`."""
        hidden, t = h.shape
        return self._native_add_rms_norm(self._lib.add_rms_norm_fm, h, delta, norm, t, hidden)

    @staticmethod
    def _native_add_rms_norm(
        kernel: Callable[..., None],
        h: torch.Tensor,
        delta: torch.Tensor | None,
        norm: torch.nn.Module,
        tokens: int,
        hidden: int,
    ) -> torch.Tensor:
        if delta is not None:
            delta = delta.contiguous()
        out = torch.empty_like(h)
        kernel(
            h.data_ptr(),
            None if delta is None else delta.data_ptr(),
            norm.weight.data_ptr(),
            out.data_ptr(),
            tokens,
            hidden,
            norm.eps,
            torch.get_num_threads(),
        )
        return out

    def silu_mul_fm(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for feature-major gate_up = [gate; up] ([2I, T]) -> [I, T]."""
        half = gate_up.shape[0] // 2
        out = gate_up.new_empty(half, gate_up.shape[1])
        self._lib.silu_mul_fm(
            gate_up.data_ptr(), out.data_ptr(), half, gate_up.shape[1], torch.get_num_threads()
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] along the last dim."""
        half = gate_up.shape[-1] // 2
        if not (self.applies(gate_up) and gate_up.is_contiguous()):
            gate, up = gate_up.split(half, dim=-1)
            # In place: the activations of a prefill chunk are tens of MB.
            return F.silu(gate, inplace=True).mul_(up)
        out = gate_up.new_empty(gate_up.shape[0], half)
        self._lib.silu_mul(
            gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], half, torch.get_num_threads()
        )
        return out

    def rotary(
        self, rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function that rotates [T, heads, D] query/key rows for this step's positions
        (tables looked up once per step, shared by every layer)."""
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        if (
            not self.applies(probe)
            or rope.cos.dtype != torch.float32
            or rope.cos.shape[-1] > _MAX_HEAD_DIM
        ):
            cos, sin = rope.cos_sin(positions, dtype)
            return lambda x: apply_rope(x, cos, sin)
        positions = positions.to(torch.int64).contiguous()

        def rotate(x: torch.Tensor) -> torch.Tensor:
            t, heads, d = x.shape
            if x.stride(2) != 1 or x.stride(1) != d:
                return apply_rope(x, *rope.cos_sin(positions, dtype))
            self._lib.rope_inplace(
                x.data_ptr(),
                x.stride(0),
                positions.data_ptr(),
                rope.cos.data_ptr(),
                rope.signed_sin.data_ptr(),
                t,
                heads,
                d,
                torch.get_num_threads(),
            )
            return x

        return rotate


def argmax_last_dim(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for [rows, vocab] logits; the transposed view that the
    feature-major decoder returns (a contiguous [vocab, rows] underneath) goes to a native
    kernel, since torch reduces across columns on one thread."""
    rows, vocab = logits.shape
    columns = logits.t()
    if (
        logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or not columns.is_contiguous()
        or rows == 0
        or (lib := _load()) is None
    ):
        return logits.argmax(dim=-1)
    out = torch.empty(rows, dtype=torch.int64)
    lib.argmax_columns(columns.data_ptr(), vocab, rows, out.data_ptr(), torch.get_num_threads())
    return out
