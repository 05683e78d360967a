"""Counter-based random draws: a request's n-th uniform depends only on (seed, n).

No generator state lives anywhere, so a draw does not depend on what else is in the batch,
on the batch order, on the device's RNG, or on which replica computes it: a request resumed
elsewhere from its first n tokens draws what it would have drawn. The hash is 32-bit
integer arithmetic (Wellons' lowbias32 finaliser) kept inside int64 without overflow, so it
gives the same bits on every device and under torch.compile.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
_SEED_SALT = 0x9E3779B9  # separates the seed's two halves and the counter


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32): split in 16-bit halves, every product < 2^49."""
    low = (x & _M16) * c
    high = (((x >> 16) * c) & _M16) << 16
    return (low + high) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) with full avalanche (int64 tensors in, int64 out)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1), one per (seed, counter) pair: int64 tensors of one shape,
    seeds any int64 (negative ones too), counters >= 0."""
    low, high = seeds & _M32, (seeds >> 32) & _M32
    key = mix32(low ^ mix32(high ^ _SEED_SALT))
    bits = mix32(key ^ mix32((counters & _M32) ^ _SEED_SALT))
    # The top 24 bits: every value is exact in float32, and +0.5 keeps 0 and 1 out.
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
