"""Decode step time against tokens per step, as one replica measured it (pure Python)."""

from __future__ import annotations

import math
from bisect import bisect_left


class StepTimeModel:
    """Seconds per decode step against its tokens: a running mean per band of step sizes
    (quarter octaves), read between bands by linear interpolation, below the smallest as
    the smallest, above the largest along the slope of the last two. Steps are flat while the
    weights' reads bound them and rise once compute does, so what one more token costs is read
    where the step will be, not from a straight line through all sizes."""

    def __init__(self, decay: float = 0.7) -> None:
        self.decay = decay  # weight of a band's previous mean at each new step in it
        self._bands: dict[int, list[float]] = {}  # band -> [mean tokens, mean seconds]
        self._points: tuple[list[float], list[float]] | None = None  # sorted, for reads

    def observe(self, num_tokens: int, seconds: float) -> None:
        band = round(4 * math.log2(max(num_tokens, 1)))
        entry = self._bands.get(band)
        if entry is None:
            self._bands[band] = [float(num_tokens), seconds]
        else:
            entry[0] += (1 - self.decay) * (num_tokens - entry[0])
            entry[1] += (1 - self.decay) * (seconds - entry[1])
        self._points = None

    @property
    def ready(self) -> bool:
        """Two step sizes measured: enough to read a cost per token."""
        return len(self._bands) >= 2

    def seconds(self, num_tokens: float) -> float:
        """The expected seconds of a decode step of `num_tokens` tokens (needs `ready`)."""
        if self._points is None:
            pairs = sorted(self._bands.values())
            self._points = [n for n, _ in pairs], [s for _, s in pairs]
        ns, ts = self._points
        i = bisect_left(ns, num_tokens)
        if i == 0:
            return ts[0]
        j = min(i, len(ns) - 1)  # above the largest: the last two bands' slope
        slope = max((ts[j] - ts[j - 1]) / max(ns[j] - ns[j - 1], 1e-9), 0.0)
        return ts[j - 1] + slope * (num_tokens - ns[j - 1])
