"""Native CPU kernels, compiled on first use with the system C compiler and called via ctypes.

No torch headers and no build step at install time: a plain C file becomes a shared library
in `build/native/` (keyed by the source's hash) in about a second. Where no compiler is
available, `load_native_decode()` returns None and the pure-torch path is used instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "native"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> Path:
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = _BUILD_DIR / f"paged_decode-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found")
    _BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=_BUILD_DIR, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", str(tmp_path), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        tmp_path.replace(target)  # atomic: concurrent builders never see a half-written file
    finally:
        tmp_path.unlink(missing_ok=True)
    return target


def load_native_decode() -> ctypes.CDLL | None:
    """The compiled kernel library, or None if it cannot be built here."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("DYNABATCH_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        logger.warning("native CPU decode kernel unavailable (%s); using pure torch", exc)
        return None
    fn = lib.paged_decode_attention
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 2
    _lib = lib
    return _lib


def native_decode_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:
    q = q.contiguous()
    block_table = block_table.contiguous()
    out = torch.empty_like(q)
    b, h, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    threads = torch.get_num_threads()
    # Whole rows per task when there are enough sequences to keep every thread busy.
    heads_per_task = hkv if b >= 4 * threads else 1
    lib.paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        hkv,
        d,
        block_size,
        block_table.shape[1],
        scale,
        heads_per_task,
        threads,
    )
    return out
