"""Summary statistics shared by the simulator and the load tests (pure Python)."""

from __future__ import annotations

import math


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
