"""Speculative decoding's side of the scheduler (pure Python): how many tokens to draft for
each request this step, the drafts themselves, and what verification found.

The adaptive rule prices a step by the replica's own measurements: T(n), the seconds of a
decode step of n tokens (engine/core/step_time_model.py), and each request's recent
acceptance rate p (its j-th draft counts with probability p^j). Drafts are given out best
first while the next one raises the step's expected tokens per second by a margin: with S
tokens expected from n, one more draft of gain g pays if g T(n) > MARGIN S (T(n+1) - T(n)),
that is (S + g) / T(n + 1) > S / T(n) with its cost counted MARGIN times. Speculation so turns
itself off in large batches and at low acceptance, where verifying costs more than it saves.
"""

from __future__ import annotations

from engine.core.config import SpeculativeConfig
from engine.core.ngram_proposer import NgramProposer, Proposer
from engine.core.outputs import SpecDecodeStats
from engine.core.request import Request
from engine.core.step_time_model import StepTimeModel

# A step without drafts now and then keeps the plain step's time measured.
EXPLORE_EVERY = 32
PRIOR_ACCEPTANCE = 0.5  # a replica's acceptance before it has verified anything
PRIOR_WEIGHT = 2.0  # drafts' worth of the replica's rate in a request's own estimate
REQUEST_DECAY = 0.8  # per verification: a request's rate follows its recent drafts
REPLICA_DECAY = 0.99
# A draft must bring this much more than it costs: step times are measured with noise and
# read beyond the sizes measured, and a draft that only breaks even is not worth the risk.
MARGIN = 1.25


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
        self._drafts: dict[str, list[int]] = {}  # this step's, by request id
        self._num_steps = 0

    # ------------------------------------------------------------------- the scheduler's
    def begin_step(self, running: list[Request]) -> None:
        """Decide this step's drafts and ask the proposer for them all at once (a draft
        model runs them as one batch), before the scheduler takes them row by row."""
        self._num_steps += 1
        self._drafts = {}
        limit = self.config.disable_by_batch_size
        on = bool(running) and (limit is None or len(running) <= limit)
        k_of = None  # every request: k_max
        if on and self.config.adaptive:
            if not self.times.ready:  # alternate until two step sizes are measured, probing
                on = self._num_steps % 2 == 1
                k_of = dict.fromkeys((r.request_id for r in running), 1)
            elif self._num_steps % EXPLORE_EVERY == 0:
                on = False
            else:
                k_of = self._plan(running)
                on = bool(k_of)
            if not on:
                self.stats.num_steps_off += 1
        if not on:
            return
        wanted = []
        for request in running:
            params = request.sampling_params
            k = self.k_max if k_of is None else k_of.get(request.request_id, 0)
            k = min(k, params.max_tokens - request.num_output_tokens - 1)
            if (
                k > 0
                and request.num_tokens - request.num_computed_tokens == 1
                and params.speculate
                and params.structured is None
                and params.logprobs is None
            ):
                wanted.append((request, k))
        if wanted:
            drafts = self.proposer.propose(wanted)
            self._drafts = {r.request_id: d for (r, _), d in zip(wanted, drafts, strict=True)}

    def drafts(self, request: Request, budget: int) -> list[int]:
        """This step's drafts for a decoding request whose last token this step computes,
        within `budget` tokens for the whole row."""
        return self._drafts.get(request.request_id, [])[: budget - 1]

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

    def _plan(self, running: list[Request]) -> dict[str, int]:
        """Drafts per request, best first, while each raises the step's expected tokens per
        second (see the module's docstring)."""
        rates = {r.request_id: self.acceptance(r.request_id) for r in running}
        seconds_of = self.times.seconds
        n = len(running)
        tokens, seconds = float(n), seconds_of(n)
        if max(rates.values()) * seconds <= MARGIN * tokens * (seconds_of(n + 1) - seconds):
            return {}
        gains = sorted(
            ((p**j, rid) for rid, p in rates.items() for j in range(1, self.k_max + 1)),
            reverse=True,
        )
        plan: dict[str, int] = {}
        for gain, rid in gains:
            longer = seconds_of(n + 1)
            if gain * seconds <= MARGIN * tokens * (longer - seconds):
                break
            plan[rid] = plan.get(rid, 0) + 1
            tokens, seconds, n = tokens + gain, longer, n + 1
        return plan
