"""Speculative decoding's side of the scheduler (pure Python): how many tokens to draft for
each request this step, the drafts themselves, and what verification found.

The adaptive rule prices a step by the replica's own measurements: T(n) and D(n), the seconds
of a decode step of n tokens without drafts and with some (engine/core/step_time_model.py),
and each request's recent acceptance rate p (its j-th draft counts with probability p^j).
Drafts are taken best first, and the step drafts the first d of them that make its expected
tokens per second highest, its extra time counted MARGIN times: (n + gains) / (T(n) + MARGIN
(D(n + d) - T(n))) against n / T(n) without drafts. A first draft so pays for the whole
step's switch to verification, and where steps cost by whole tiles of tokens (the CPU's
native GEMM streams the weights once per 16 tokens) for the tile it opens, which the drafts
after it fill nearly for free. Speculation turns itself off in large batches and at low
acceptance, where verifying costs more than it saves.

The model can be wrong on a given host (a drafted step leaves a fast decode path it does not
see), so what drafting really brought is checked after the fact: before drafting at a batch
size, a plain step is measured there, and the DraftLedger (engine/core/draft_ledger.py) stops
drafting for a while at any batch size where drafted steps did not beat plain ones. Asking
the proposer has a cost of its own where steps are launched ahead (a GPU): prompt lookup that
found nothing in the text rests a few steps after each dry answer (DRY_HOLD_MAX), until a
request it has not read yet joins the batch.
"""

from __future__ import annotations

import math
from heapq import heapify, heappop, heappush

from engine.core.config import SpeculativeConfig
from engine.core.draft_ledger import DraftLedger
from engine.core.ngram_proposer import NgramProposer, Proposer
from engine.core.outputs import SpecDecodeStats
from engine.core.request import Request
from engine.core.step_time_model import StepTimes

# A step without drafts now and then keeps the plain step's time measured.
EXPLORE_EVERY = 32
PRIOR_ACCEPTANCE = 0.5  # a replica's acceptance before it has verified anything
PRIOR_WEIGHT = 2.0  # drafts' worth of the prior in the replica's rate, and of the replica's
# rate in a request's own estimate
REQUEST_DECAY = 0.8  # per verification: a request's rate follows its recent drafts
# Per verification, and per step without drafts: a replica whose drafts failed drifts back
# to the prior while it drafts nothing, and so tries new requests again now and then (a
# request's own record fades at the same pace while it drafts nothing).
REPLICA_DECAY = 0.99
# A draft must bring this much more than it costs: step times are measured with noise and
# read beyond the sizes measured, and a draft that only breaks even is not worth the risk.
MARGIN = 1.25
# A drafted step is at most this many times the larger of its rows and the largest drafted
# step measured (and at least one tile more than its rows): beyond what was measured the
# model reads step times flat, so it may step a quarter octave into the unknown at a time,
# each step measuring the next (and scored by the ledger), never a leap.
GROWTH = 1.25
# A proposer that found no draft for any row in text that offers none (prompt lookup on text
# that does not repeat) is not asked again for 1, 2, 4, ... steps, up to this many: asking
# stops the next step from being scheduled before this one's tokens are in, which a GPU
# pays for in every step.
DRY_HOLD_MAX = 16


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer | None = None, token_tile: int = 1
    ) -> None:
        self.config = config
        self.k_max = config.num_speculative_tokens
        if proposer is None:
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.proposer = proposer
        self.times = StepTimes(token_tile)  # token_tile: see StepTimeModel
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.k_max)
        # request id -> [accepted, tried, the step they are as of], decayed
        self._rates: dict[str, list[float]] = {}
        self._replica = [0.0, 0.0]  # [accepted, tried], decayed
        self._drafts: dict[str, list[int]] = {}  # this step's, by request id
        self._num_steps = 0
        self.ledger = DraftLedger()
        # The last drafted decode step, (rows, seconds), until its verified rows are in.
        self._drafted_step: tuple[int, float] | None = None
        self._accepted_since = 0  # accepted drafts verified since that step
        # The adaptive rule found no draft worth its step among requests that all decode
        # (not a pause to measure), or the batch is over disable_by_batch_size: the next
        # step, with the same requests, may be scheduled before this one's tokens are in
        # (engine/core/sched/continuation.py).
        self._quiet = False
        self._num_dry = 0  # proposals in a row that found no draft for any row
        self._hold = 0  # steps left before the proposer is asked again
        self._asked: set[str] = set()  # requests the proposer has been asked about

    # ------------------------------------------------------------------- the scheduler's
    def begin_step(self, running: list[Request]) -> None:
        """Decide this step's drafts and ask the proposer for them all at once (a draft
        model runs them as one batch), before the scheduler takes them row by row."""
        self._num_steps += 1
        self._drafts = {}
        self._settle_drafted_step()
        limit = self.config.disable_by_batch_size
        over_limit = limit is not None and len(running) > limit
        wanted, settled = self._eligible(running) if not over_limit else ([], True)
        quiet = over_limit
        if wanted and self.config.adaptive:
            times, n = self.times, len(running)
            pause = (
                not times.ready
                or self._num_steps % EXPLORE_EVERY == 0
                or not times.plain.measured(n)
            )
            wanted = self._adapted(n, wanted)
            if not wanted:
                self.stats.num_steps_off += 1
                quiet = settled and not pause
        if wanted and any(r.request_id not in self._asked for r, _ in wanted):
            # The rest was earned by other requests' text: a new one is read at once.
            self._hold = self._num_dry = 0
        if wanted and self._hold > 0:
            self._hold -= 1
            wanted = []
        self._quiet = quiet
        if wanted:
            self._asked.update(r.request_id for r, _ in wanted)
            drafts = self.proposer.propose(wanted)
            self._drafts = {r.request_id: d for (r, _), d in zip(wanted, drafts, strict=True) if d}
            if self._drafts:
                self._num_dry = 0
                return
            if not self.proposer.dry_means_none_soon:
                return
            self._num_dry += 1
            self._hold = min(2 ** (self._num_dry - 1), DRY_HOLD_MAX)
        replica = self._replica
        replica[0] *= REPLICA_DECAY
        replica[1] *= REPLICA_DECAY

    def continues(self) -> bool:
        """Whether the next step, with the same requests, may be scheduled before this one's
        tokens are in: no drafts are wanted in it (and a step so scheduled counts as one
        that does not ask the proposer)."""
        if self._quiet:
            return True
        if self._hold > 0:
            self._hold -= 1
            return True
        return False

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
        self._accepted_since += num_accepted
        tried = num_accepted + (num_accepted < num_drafts)  # drafts up to the first miss
        accepted, past = self._own(request_id)
        self._rates[request_id] = [
            REQUEST_DECAY * accepted + num_accepted,
            REQUEST_DECAY * past + tried,
            self._num_steps,
        ]
        replica = self._replica
        replica[0] = REPLICA_DECAY * replica[0] + num_accepted
        replica[1] = REPLICA_DECAY * replica[1] + tried

    def observe_step(self, num_tokens: int, seconds: float, num_drafts: int) -> None:
        """A decode step (no prefill chunk) of `num_tokens` tokens, `num_drafts` of them
        drafts, took `seconds`. Its rows are verified after this (the ledger's score waits
        for them)."""
        drafted = num_drafts > 0
        if drafted and self.times.plain.num_bands:
            self._drafted_step = (num_tokens - num_drafts, seconds)
            self._accepted_since = 0
        self.times.observe(num_tokens, seconds, drafted)

    @property
    def num_steps(self) -> int:
        """Steps it was asked about (begin_step), launched-ahead steps not counted."""
        return self._num_steps

    def forget(self, request_id: str) -> None:
        self._rates.pop(request_id, None)
        self._asked.discard(request_id)
        self.proposer.forget(request_id)

    # ------------------------------------------------------------------------ helpers
    def _settle_drafted_step(self) -> None:
        """Score the last drafted step in the ledger, its verified rows now counted."""
        if self._drafted_step is None:
            return
        rows, seconds = self._drafted_step
        self._drafted_step = None
        plain = self.times.plain_seconds(rows)
        self.ledger.record(rows, rows + self._accepted_since, seconds, plain, self._num_steps)

    def acceptance(self, request_id: str) -> float:
        """A request's estimated chance that a draft counts: its own recent drafts, pulled
        toward the replica's rate (itself pulled toward the prior) while it has few."""
        accepted, tried = self._replica
        prior = (accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (tried + PRIOR_WEIGHT)
        own_accepted, own_tried = self._own(request_id)
        return (own_accepted + PRIOR_WEIGHT * prior) / (own_tried + PRIOR_WEIGHT)

    def _own(self, request_id: str) -> tuple[float, float]:
        """A request's decayed [accepted, tried], faded as the replica's are for each step
        since its last verification: a request whose few drafts failed is tried again
        after a while, as a new one would be, not written off for its whole life."""
        rate = self._rates.get(request_id)
        if rate is None:
            return 0.0, 0.0
        fade = REPLICA_DECAY ** (self._num_steps - rate[2])
        return rate[0] * fade, rate[1] * fade

    def _eligible(self, running: list[Request]) -> tuple[list[tuple[Request, int]], bool]:
        """The decoding requests that may draft this step, with the most drafts each may;
        and whether every running request is decoding (none waits for a prompt chunk)."""
        eligible = []
        settled = True
        for request in running:
            params = request.sampling_params
            k = min(self.k_max, params.max_tokens - request.num_output_tokens - 1)
            decoding = request.num_tokens - request.num_computed_tokens == 1
            settled = settled and decoding and request.num_output_tokens > 0
            if (
                k > 0
                and decoding
                and params.speculate
                and params.structured is None
                and params.logprobs is None
            ):
                eligible.append((request, k))
        return eligible, settled

    def _adapted(self, n: int, eligible: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """The adaptive rule's drafts for a step of `n` rows."""
        times = self.times
        if not times.ready:  # measure a plain step, then one row drafting one token
            return [(eligible[0][0], 1)] if times.plain.num_bands else []
        if self._num_steps % EXPLORE_EVERY == 0:  # measure a plain step
            return []
        if not times.plain.measured(n):  # a batch size new to plain steps: measure it first
            return []
        if not self.ledger.allows(n, self._num_steps):  # drafts lost here lately
            return []
        plan = self._plan(n, eligible)
        return [(r, plan[r.request_id]) for r, _ in eligible if r.request_id in plan]

    def _plan(self, n: int, eligible: list[tuple[Request, int]]) -> dict[str, int]:
        """Drafts per request id (see the module's docstring)."""
        rates = [(self.acceptance(r.request_id), r.request_id, cap) for r, cap in eligible]
        plain = self.times.plain_seconds(n)
        drafted = self.times.drafted_seconds

        def cost(num_tokens: int) -> float:
            return plain + MARGIN * max(drafted(num_tokens) - plain, 0.0)

        # Every draft at the cheapest drafted step: if even that does not pay, none does.
        most = sum(cap if p >= 1 else p * (1 - p**cap) / (1 - p) for p, _, cap in rates)
        if (n + most) / cost(n + 1) <= n / plain:
            return {}
        heap = [(-p, 1, rid, p, cap) for p, rid, cap in rates if p > 0]
        heapify(heap)
        tile = self.times.tile
        known = max(self.times.excess.largest(), n)
        most_drafts = max(math.ceil(GROWTH * known), n + tile) - n
        order: list[str] = []
        tokens, best, best_d, last = float(n), n / plain, 0, None
        while heap and len(order) < most_drafts:
            gain, j, rid, p, cap = heappop(heap)
            if j < cap:
                heappush(heap, (gain * p, j + 1, rid, p, cap))
            order.append(rid)
            tokens -= gain
            if (n + len(order)) % tile and heap and len(order) < most_drafts:
                continue  # a step costs by whole tiles: priced where one is full
            score = tokens / cost(n + len(order))
            if score > best:
                best, best_d = score, len(order)
            elif last is not None and score < last:
                break  # past the first draft, the drafts left bring less than they cost
            last = score
        plan: dict[str, int] = {}
        for rid in order[:best_d]:
            plan[rid] = plan.get(rid, 0) + 1
        return plan
