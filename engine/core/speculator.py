"""Speculative decoding's side of the scheduler (pure Python): how many tokens to draft for
each request this step, the drafts themselves, and what verification found.

The adaptive rule prices a step by the replica's own measurements. Decode step time is
modelled as T(n) = a + b n over n tokens per step (StepTimeModel, fitted to the decode steps
the replica collected, recent ones weighing most: b is what a draft costs at today's batch);
each request's drafts are accepted one after another with its recent acceptance rate p (its
j-th draft counts with probability p^j). A draft is worth its place while the tokens it is
expected to add per second of step beat the step's: p^j / b > tokens / T. Drafts are given
out best first until the next one would not pay, so speculation turns itself off in large
batches and at low acceptance, and throughput never falls below decoding without it.
"""

from __future__ import annotations

from engine.core.config import SpeculativeConfig
from engine.core.ngram_proposer import NgramProposer, Proposer
from engine.core.outputs import SpecDecodeStats
from engine.core.request import Request

# A step without drafts now and then keeps both ends of the step-time fit measured.
EXPLORE_EVERY = 32
PRIOR_ACCEPTANCE = 0.5  # a replica's acceptance before it has verified anything
PRIOR_WEIGHT = 2.0  # drafts' worth of the replica's rate in a request's own estimate
REQUEST_DECAY = 0.8  # per verification: a request's rate follows its recent drafts
REPLICA_DECAY = 0.99


class StepTimeModel:
    """Seconds per step against tokens per step, T(n) = a + b n, by exponentially weighted
    least squares over the steps observed (recent steps weigh most)."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self._sums = [0.0] * 5  # weight, x, y, x^2, x*y

    def observe(self, num_tokens: int, seconds: float) -> None:
        d, x, y = self.decay, float(num_tokens), seconds
        w, sx, sy, sxx, sxy = self._sums
        self._sums = [d * w + 1, d * sx + x, d * sy + y, d * sxx + x * x, d * sxy + x * y]

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until steps of different sizes have been seen."""
        w, sx, sy, sxx, sxy = self._sums
        if w < 4:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var < 0.1:  # every step about the same size: no slope to read
            return None
        slope = max((sxy / w - mx * my) / var, 1e-9)
        return max(my - slope * mx, 0.0), slope


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.k_max = config.num_speculative_tokens
        if proposer is None:
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.proposer = proposer
        self.times = StepTimeModel()
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.k_max)
        self._rates: dict[str, list[float]] = {}  # request id -> [accepted, tried], decayed
        self._replica = [PRIOR_ACCEPTANCE * PRIOR_WEIGHT, PRIOR_WEIGHT]
        self._k: dict[str, int] = {}  # this step's drafts per request (adaptive)
        self._on = False
        self._num_steps = 0

    # ------------------------------------------------------------------- the scheduler's
    def begin_step(self, running: list[Request]) -> None:
        """Decide this step's drafts per request, before the scheduler asks for them."""
        self._num_steps += 1
        limit = self.config.disable_by_batch_size
        self._on = bool(running) and (limit is None or len(running) <= limit)
        if not self._on or not self.config.adaptive:
            return
        fit = self.times.fit()
        if fit is None:  # alternate until both step sizes are measured, probing with 1
            self._on = self._num_steps % 2 == 1
            self._k = dict.fromkeys((r.request_id for r in running), 1)
        elif self._num_steps % EXPLORE_EVERY == 0:
            self._on = False
        else:
            self._k = self._plan(running, *fit)
            self._on = bool(self._k)
        if not self._on:
            self.stats.num_steps_off += 1

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request whose last token this step computes, within
        `budget` tokens for the whole row."""
        if not self._on:
            return []
        params = request.sampling_params
        if not params.speculate or params.structured is not None or params.logprobs is not None:
            return []
        k = self._k.get(request.request_id, 0) if self.config.adaptive else self.k_max
        k = min(k, budget - 1, params.max_tokens - request.num_output_tokens - 1)
        return self.proposer.propose(request, k) if k > 0 else []

    def verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A row's drafts were verified: `num_accepted` of `num_drafts` counted."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        tried = num_accepted + (num_accepted < num_drafts)  # drafts up to the first miss
        rate = self._rates.setdefault(request_id, [0.0, 0.0])
        rate[0] = REQUEST_DECAY * rate[0] + num_accepted
        rate[1] = REQUEST_DECAY * rate[1] + tried
        replica = self._replica
        replica[0] = REPLICA_DECAY * replica[0] + num_accepted
        replica[1] = REPLICA_DECAY * replica[1] + tried

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode step (no prefill chunk) of `num_tokens` tokens took `seconds`."""
        self.times.observe(num_tokens, seconds)

    def forget(self, request_id: str) -> None:
        self._rates.pop(request_id, None)
        self.proposer.forget(request_id)

    # ------------------------------------------------------------------------ helpers
    def acceptance(self, request_id: str) -> float:
        """A request's estimated chance that a draft counts: its own recent drafts, pulled
        toward the replica's rate while it has few."""
        accepted, tried = self._replica
        prior = accepted / tried
        own = self._rates.get(request_id, (0.0, 0.0))
        return (own[0] + PRIOR_WEIGHT * prior) / (own[1] + PRIOR_WEIGHT)

    def _plan(self, running: list[Request], a: float, b: float) -> dict[str, int]:
        """Drafts per request, best first, while each adds more tokens per second than the
        step without it makes (see the module's docstring)."""
        rates = {r.request_id: self.acceptance(r.request_id) for r in running}
        tokens, seconds = float(len(running)), a + b * len(running)
        if max(rates.values()) * seconds <= b * tokens:
            return {}
        gains = sorted(
            ((p**j, rid) for rid, p in rates.items() for j in range(1, self.k_max + 1)),
            reverse=True,
        )
        plan: dict[str, int] = {}
        for gain, rid in gains:
            if gain * seconds <= b * tokens:
                break
            plan[rid] = plan.get(rid, 0) + 1
            tokens += gain
            seconds += b
        return plan
