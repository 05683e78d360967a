"""A cumulative histogram in plain Python (Prometheus semantics: counts per upper bound)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


@dataclass(frozen=True)
class HistogramSnapshot:
    """Counts per bucket (the last one is +Inf), their sum and total: Prometheus's shape."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # len(bounds) + 1, not cumulative
    total: float
    count: int


class CumulativeHistogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram bounds must increase strictly")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.total += value * n
        self.count += n

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total, self.count)
