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

    def __init__(self, decay: float = 0.7, tile: int = 1) -> None:
        self.decay = decay  # weight of a band's previous mean at each new step in it
        # Steps cost by whole tiles of this many tokens (the GEMM streams the weights once
        # per tile): sizes are rounded up to whole tiles, and each of the first 16 tiles is
        # a band of its own (quarter octaves would merge a full tile with the next's first).
        self.tile = tile
        self._bands: dict[tuple[int, int], list[float]] = {}  # -> [mean tokens, mean seconds]
        self._points: tuple[list[float], list[float]] | None = None  # sorted, for reads

    def observe(self, num_tokens: int, seconds: float) -> None:
        num_tokens = self.rounded(num_tokens)
        band = self._band(num_tokens)
        entry = self._bands.get(band)
        if entry is None:
            self._bands[band] = [float(num_tokens), seconds]
        else:
            entry[0] += (1 - self.decay) * (num_tokens - entry[0])
            entry[1] += (1 - self.decay) * (seconds - entry[1])
        self._points = None

    def measured(self, num_tokens: int) -> bool:
        """Whether steps of `num_tokens` tokens' band have been measured."""
        return self._band(self.rounded(num_tokens)) in self._bands

    def _band(self, num_tokens: int) -> tuple[int, int]:
        tiles = num_tokens // self.tile
        if self.tile > 1 and tiles <= 16:
            return (0, tiles)
        return (1, round(4 * math.log2(num_tokens)))

    def rounded(self, num_tokens: float) -> int:
        """`num_tokens` up to whole tiles (at least one)."""
        return max(1, -(-math.ceil(num_tokens) // self.tile)) * self.tile

    @property
    def num_bands(self) -> int:
        return len(self._bands)

    def largest(self) -> float:
        """The largest step size measured (its band's mean; 0 before any)."""
        return max((n for n, _ in self._bands.values()), default=0.0)

    def seconds_within(self, num_tokens: float) -> float:
        """As `seconds`, but flat above the largest size measured (needs one band)."""
        ns, ts = self._read_points()
        return ts[-1] if self.rounded(num_tokens) >= ns[-1] else self.seconds(num_tokens)

    def seconds(self, num_tokens: float) -> float:
        """The expected seconds of a decode step of `num_tokens` tokens (with one band
        measured: that band's)."""
        num_tokens = self.rounded(num_tokens)
        ns, ts = self._read_points()
        i = bisect_left(ns, num_tokens)
        if i == 0 or len(ns) == 1:
            return ts[0]
        j = min(i, len(ns) - 1)  # above the largest: the last two bands' slope
        slope = max((ts[j] - ts[j - 1]) / max(ns[j] - ns[j - 1], 1e-9), 0.0)
        return ts[j - 1] + slope * (num_tokens - ns[j - 1])

    def _read_points(self) -> tuple[list[float], list[float]]:
        if self._points is None:
            pairs = sorted(self._bands.values())
            self._points = [n for n, _ in pairs], [s for _, s in pairs]
        return self._points


class StepTimes:
    """Decode step times apart for steps with drafts and without: any drafted row takes a
    step off the plain decode path (its rows verify several query tokens), and that costs a
    step more than its extra tokens do, so a first draft must pay for the switch.

    T(n), a plain step of n tokens, is measured as is; a drafted step of n tokens as its
    excess over T(n) read when it ran: D(n) = T(n) + E(n). The excess, the switch's cost and
    its drafted tokens', is measured far more rarely than T (only where drafting pays); kept
    as an excess it follows T when the host speeds up or slows down, so a slow moment of the
    plain steps does not make a first draft look free. The excess is read as the band model
    reads (flat where one size is measured), T flat above the largest size measured."""

    def __init__(self, tile: int = 1) -> None:
        self.tile = tile
        self.plain = StepTimeModel(tile=tile)
        self.excess = StepTimeModel(tile=tile)  # drafted steps' seconds over the plain ones

    @property
    def ready(self) -> bool:
        return self.plain.num_bands >= 1 and self.excess.num_bands >= 1

    def observe(self, num_tokens: int, seconds: float, drafted: bool) -> None:
        if not drafted:
            self.plain.observe(num_tokens, seconds)
        elif self.plain.num_bands:
            self.excess.observe(num_tokens, seconds - self.plain_seconds(num_tokens))

    def plain_seconds(self, num_tokens: float) -> float:
        """T(n) (needs a plain step measured), flat above the largest measured: drafted
        steps are larger than any plain one of their rows, and their excess is measured
        against this reading."""
        return self.plain.seconds_within(num_tokens)

    def drafted_seconds(self, num_tokens: float) -> float:
        """D(n) (needs `ready`)."""
        return self.plain_seconds(num_tokens) + max(self.excess.seconds(num_tokens), 0.0)
