"""4-bit integers packed eight to an int32, in the orders the public formats use.

Nibble j of a word (bits 4j..4j+3) holds element `order[j]` of its run of eight. GPTQ packs
sequentially (qweight along the input dimension, qzeros along the output dimension); AWQ's
GEMM format interleaves its eight output columns as AWQ_ORDER. Our own layout
(engine/quant/linear.py) packs sequentially along the input dimension of an [out, in] weight.
"""

from __future__ import annotations

import torch

SEQUENTIAL = (0, 1, 2, 3, 4, 5, 6, 7)
# AutoAWQ's pack order: nibble j holds column AWQ_ORDER[j] of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_columns(q: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL) -> torch.Tensor:
    """uint8 [R, C] of values 0..15 -> int32 [R, C/8], eight columns to a word."""
    rows, cols = q.shape
    if cols % 8:
        raise ValueError(f"{cols} columns do not pack eight to a word")
    runs = q.to(torch.int64).reshape(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for nibble, column in enumerate(order):
        words |= (runs[:, :, column] & 0xF) << (4 * nibble)
    return _to_int32(words)


def unpack_columns(words: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL) -> torch.Tensor:
    """int32 [R, C/8] -> uint8 [R, C] (the inverse of `pack_columns`)."""
    rows, packed = words.shape
    wide = words.to(torch.int64)
    out = torch.empty(rows, packed, 8, dtype=torch.uint8, device=words.device)
    for nibble, column in enumerate(order):
        out[:, :, column] = ((wide >> (4 * nibble)) & 0xF).to(torch.uint8)
    return out.reshape(rows, packed * 8)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R/8, C], eight rows to a word (GPTQ's qweight)."""
    return pack_columns(q.t().contiguous()).t().contiguous()


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] -> uint8 [R, C] (the inverse of `pack_rows`)."""
    return unpack_columns(words.t().contiguous()).t().contiguous()
