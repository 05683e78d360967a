"""A step's sampled rows drawn on the GPU in one kernel, without a sort
(engine/sampling/token_draw.py holds the definition, by sort, that it is tested against).

One Triton program per row reads the row's logits, temperature applied as they load, and
finds the lowest logit its filters keep by searching the float32 values as ordered 32-bit
keys: each pass over the row splits the remaining key range into 16 buckets and sums, per
bucket, the count (top-k) or the unnormalised probability (top-p) of the tokens inside, so
eight passes narrow 2^32 keys to the one value at the boundary. Then one pass sums the kept
mass and one walks the row in vocabulary order to the token where the running mass passes
u x that sum. Rows without filters make three passes. Nothing of the size of the logits is
written: a full sort of 256 rows of a 128k vocabulary, and the softmax and cumulative sum
around it, would write several copies.

With `TRITON_INTERPRET=1` (set before this module is imported) it runs on CPU tensors, which
is how the tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Triton kernels read module globals only as constexprs.
_PASSES = tl.constexpr(8)  # 16 buckets a pass: 16^8 = 2^32 keys narrow to one
# The keys of -inf and +inf: the keys outside are NaNs'.
_KEY_MIN = tl.constexpr(-0x7F800001)
_KEY_MAX = tl.constexpr(0x7F800000)


@triton.jit
def _load(row_ptr, start, vocab, temperature, BLOCK: tl.constexpr):
    """A block of the row, temperature applied, and which of its columns exist. The division
    rounds as torch's does (a GPU's `/` is approximate): the row keeps what the definition
    keeps, to the last bit."""
    offs = start + tl.arange(0, BLOCK)
    valid = offs < vocab
    x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    return tl.div_rn(x, temperature), valid, offs


@triton.jit
def _ordered_key(x):
    """float32 -> int32 in the floats' order (an involution on the bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """The float32 whose ordered key is `key` (int64 within the int32 range)."""
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _bucket_weights(
    row_ptr, vocab, temperature, lo, hi, row_max, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr
):
    """Per bucket of [lo, hi] (16 of `step` keys each), the weight of the tokens inside it;
    and the weight of the tokens above hi. A token weighs 1 (BY_COUNT) or exp(x - max)."""
    buckets = tl.arange(0, 16)
    step = (hi - lo + 16) // 16
    inside = tl.zeros([16], dtype=tl.float32)
    above = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        x, valid, _ = _load(row_ptr, start, vocab, temperature, BLOCK)
        key = _ordered_key(x).to(tl.int64)
        if BY_COUNT:
            weight = tl.where(valid, 1.0, 0.0)
        else:
            weight = tl.where(valid, tl.exp(x - row_max), 0.0)
        bucket = tl.where((key >= lo) & (key <= hi), (key - lo) // step, -1)
        hit = bucket[:, None] == buckets[None, :]
        inside += tl.sum(tl.where(hit, weight[:, None], 0.0), axis=0)
        above += tl.where(key > hi, weight, 0.0)
    return inside, tl.sum(above, axis=0), step


@triton.jit
def _search(
    row_ptr, vocab, temperature, lo, target, row_max, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr
):
    """The largest key v >= lo with weight(keys >= v) >= target (lo itself when none is)."""
    hi = tl.full([], _KEY_MAX, tl.int64)
    buckets = tl.arange(0, 16)
    for _ in range(_PASSES):
        inside, above, step = _bucket_weights(
            row_ptr, vocab, temperature, lo, hi, row_max, BY_COUNT, BLOCK
        )
        # at_or_above[b]: the weight of the keys >= lo + b * step
        at_or_above = above + tl.sum(
            tl.where(buckets[None, :] >= buckets[:, None], inside[None, :], 0.0), axis=1
        )
        b = tl.max(tl.where(at_or_above >= target, buckets, 0), axis=0).to(tl.int64)
        lo = lo + b * step
        hi = tl.minimum(hi, lo + step - 1)
    return lo


@triton.jit
def _kept_mass(row_ptr, vocab, temperature, threshold, row_max, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        x, valid, _ = _load(row_ptr, start, vocab, temperature, BLOCK)
        total += tl.where(valid & (x >= threshold), tl.exp(x - row_max), 0.0)
    return tl.sum(total, axis=0)


@triton.jit
def _draw(
    logits_ptr,  # [rows, vocab], any float dtype
    row_stride,
    temperature_ptr,  # [rows] float32
    top_k_ptr,  # [rows] int64: vocab where the row has no top-k
    top_p_ptr,  # [rows] float32: 1.0 where none
    min_p_ptr,  # [rows] float32: 0.0 where none
    u_ptr,  # [rows] float32 in (0, 1)
    token_ptr,  # [rows] int64, out
    threshold_ptr,  # [rows] float32, out: the lowest logit (temperature applied) kept
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    temperature = tl.load(temperature_ptr + row)
    row_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        x, _, _ = _load(row_ptr, start, vocab, temperature, BLOCK)
        row_max = tl.maximum(row_max, x)
    row_max = tl.max(row_max, axis=0)

    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    floor = tl.full([], _KEY_MIN, tl.int64)
    if top_k < vocab:
        floor = _search(
            row_ptr, vocab, temperature, floor, top_k.to(tl.float32), row_max, True, BLOCK
        )
    threshold = _key_value(floor)
    if top_p < 1.0:  # over what top-k keeps
        target = top_p * _kept_mass(row_ptr, vocab, temperature, threshold, row_max, BLOCK)
        floor = _search(row_ptr, vocab, temperature, floor, target, row_max, False, BLOCK)
        threshold = _key_value(floor)
    if min_p > 0.0:  # probability at least min_p x the top token's: x >= max + log(min_p)
        threshold = tl.maximum(threshold, row_max + tl.log(min_p))
    tl.store(threshold_ptr + row, threshold)

    # Inverse CDF in vocabulary order: the first kept token whose running mass passes u x
    # the kept mass (the last kept one where rounding leaves the target out of reach).
    target = tl.load(u_ptr + row) * _kept_mass(
        row_ptr, vocab, temperature, threshold, row_max, BLOCK
    )
    running = tl.zeros([], dtype=tl.float32)
    first = tl.full([], vocab, tl.int64)
    last = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        x, valid, offs = _load(row_ptr, start, vocab, temperature, BLOCK)
        weight = tl.where(valid & (x >= threshold), tl.exp(x - row_max), 0.0)
        passed = (running + tl.cumsum(weight, axis=0) > target) & (weight > 0.0)
        first = tl.minimum(first, tl.min(tl.where(passed, offs, vocab), axis=0).to(tl.int64))
        last = tl.maximum(last, tl.max(tl.where(weight > 0.0, offs, 0), axis=0).to(tl.int64))
        running += tl.sum(weight, axis=0)
    tl.store(token_ptr + row, tl.where(first < vocab, first, last))


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 tokens [rows], and the float32 thresholds (the lowest logit each row kept,
    temperature applied). Arguments as in engine/sampling/token_draw.py's `draw_by_sort`."""
    rows, vocab = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    thresholds = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _draw[(rows,)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p, u, tokens,
            thresholds, vocab, BLOCK=1024, num_warps=8,
        )  # fmt: skip
    return tokens, thresholds
