"""What drafting really brought, batch size by batch size (pure Python).

The adaptive rule decides from a model of step times; the ledger checks the decision after
the fact. Each decode step with drafts is scored by the tokens it produced per second
against what plain steps of as many rows produce, T(n) measured there:
r = (rows + accepted) / seconds / (rows / T(rows)). Per band of batch sizes (quarter
octaves), the mean score of its last JUDGE_AFTER drafted steps must reach GAIN_NEEDED; where
it does not, the band drafts nothing for FIRST_COOLDOWN steps, twice as long each time it
fails again (up to MAX_COOLDOWN), and then tries again. So drafting costs at most
JUDGE_AFTER steps' losses per cooldown at any batch size on any host, and that share falls
as the cooldowns grow.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

JUDGE_AFTER = 3  # drafted steps of a band that make a verdict (one step's time is noisy)
# Drafted steps must beat plain ones by this much: their scores carry the noise of two
# measured times, and a draft that only breaks even is not worth its risk.
GAIN_NEEDED = 1.02
FIRST_COOLDOWN = 64  # steps
MAX_COOLDOWN = 4096


@dataclass
class _Band:
    scores: deque[float] = field(default_factory=lambda: deque(maxlen=JUDGE_AFTER))
    off_until: int = 0  # the step number from which the band may draft again
    cooldown: int = FIRST_COOLDOWN


class DraftLedger:
    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}

    @staticmethod
    def band(rows: int) -> int:
        return round(4 * math.log2(max(rows, 1)))

    def allows(self, rows: int, step: int) -> bool:
        """Whether a step of `rows` decoding rows (the `step`-th) may draft."""
        band = self._bands.get(self.band(rows))
        return band is None or step >= band.off_until

    def record(self, rows: int, produced: int, seconds: float, plain_seconds: float, step: int):
        """A decode step of `rows` rows with drafts made `produced` tokens in `seconds`;
        plain steps of as many rows take `plain_seconds`."""
        if seconds <= 0 or rows <= 0:
            return
        band = self._bands.setdefault(self.band(rows), _Band())
        band.scores.append(produced * plain_seconds / (rows * seconds))
        if len(band.scores) < JUDGE_AFTER:
            return
        if sum(band.scores) / len(band.scores) >= GAIN_NEEDED:
            band.cooldown = FIRST_COOLDOWN  # it pays: a later failure starts short again
            return
        band.off_until = step + band.cooldown
        band.cooldown = min(2 * band.cooldown, MAX_COOLDOWN)
        band.scores.clear()

    def score(self, rows: int) -> float | None:
        """The band's mean score over its recent drafted steps (None: none since its last
        verdict against it)."""
        band = self._bands.get(self.band(rows))
        if band is None or not band.scores:
            return None
        return sum(band.scores) / len(band.scores)
