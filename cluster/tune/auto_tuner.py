"""Self-tuning: the tuner run on the last window of a fleet's own traffic every period, its
answer applied only where the simulator predicts it pays, and taken back where the traffic
it was chosen for is gone.

Every `period_s` the AutoTuner:
1. While a setting it applied is in force, compares the attainment measured in the period
   (requests that finished, and those already past the TTFT objective without a first
   token) with what it predicted for it; short by more than `tolerance` (the traffic it was
   chosen for is gone), it reverts to the setting before, which it keeps off the table for
   `cooldown_periods`.
2. Else, on the requests of the last `window_s` (at least `min_requests` of them), prices the
   setting in force and searches the operator's grid (`space`: the bounds it may move in)
   with `trials` runs. It applies the cheapest setting that meets the target when that costs
   at least `margin` fewer replica-hours than the setting in force, or when the setting in
   force misses the target.
Each change is kept in `changes` (the log; the deployed app would export it as
`dynabatch:tuning_applied_total`). A window is simulated from a fleet at its start size, not
the live fleet's state at the window's start: a prediction, checked by step 1.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

from cluster.batching import make_policy
from cluster.cluster_sim import ClusterSimConfig, Retune
from cluster.request_records import RequestRecord, Slo, summarize_records
from cluster.tune.problem import Problem
from cluster.tune.report import Target, cheapest
from cluster.tune.search import search
from cluster.tune.space import REPORT_INTERVAL_S, Setting, Space
from cluster.tune.trial_pool import TrialPool
from cluster.workload import SimRequest
from engine.runner.cost_model import CostParams, GpuSpec, ModelSpec


@dataclass(frozen=True)
class AutoTuning:
    """How often and how boldly it tunes (deploy.yaml would call it `tuning:`)."""

    period_s: float = 600.0
    window_s: float = 1800.0
    trials: int = 12
    margin: float = 0.05  # the least share of replica-hours a change must save
    tolerance: float = 0.02  # measured attainment this far under the predicted: revert
    min_requests: int = 50  # a window with fewer decides nothing
    cooldown_periods: int = 3  # a reverted setting is not applied again for this long


@dataclass(frozen=True)
class TuningChange:
    at_s: float
    kind: str  # "apply" or "revert"
    setting: Setting
    reason: str
    predicted: dict[str, Any] | None = None  # its trial on the window (apply)


def _key(setting: Setting) -> str:
    return json.dumps(asdict(setting), sort_keys=True)


class AutoTuner:
    """A cluster_sim.Retuner: `start` the setting the fleet was deployed with."""

    def __init__(
        self,
        tuning: AutoTuning,
        space: Space,
        target: Target,
        replica: tuple[ModelSpec, GpuSpec, CostParams],
        start: Setting,
        pool: TrialPool | None = None,
        seed: int = 0,
    ) -> None:
        self.tuning, self.space, self.target = tuning, space, target
        self.replica, self.pool, self.seed = replica, pool, seed
        self.period_s, self.window_s = tuning.period_s, tuning.window_s
        self.current = start
        self.previous: Setting | None = None  # before the last apply (None: after a revert)
        self.predicted: dict[str, Any] | None = None  # the last apply's trial on its window
        self.blocked: dict[str, float] = {}  # reverted settings -> until when
        self.changes: list[TuningChange] = []

    def retune(
        self, now: float, window: list[SimRequest], measured: list[RequestRecord]
    ) -> Retune | None:
        if self.previous is not None and self.predicted is not None:
            attained = self.attainment(now, measured)
            if attained is not None:
                expected = self.predicted["sla_attainment"]
                if attained < expected - self.tuning.tolerance:
                    reason = f"measured {attained:.3f} against the predicted {expected:.3f}"
                    return self._revert(now, reason)
        if len(window) < self.tuning.min_requests:
            return None
        start = window[0].arrival_s
        trace = [replace(r, arrival_s=r.arrival_s - start) for r in window]
        model, gpu, cost = self.replica
        problem = Problem(trace, model, gpu, cost, self.target.slo)
        here = problem.trial(self.current)
        trials, _ = search(problem, self.space, self.tuning.trials, None, self.pool, self.seed)
        allowed = [
            t
            for t in trials
            if self.blocked.get(_key(Setting(**t["setting"])), -math.inf) <= now
            and Setting(**t["setting"]) != self.current
        ]
        best = cheapest(allowed, self.target)
        if best is None:
            return None
        saves = 1 - best["replica_hours"] / max(here["replica_hours"], 1e-12)
        if self.target.met(here) and saves < self.tuning.margin:
            return None
        reason = (
            f"{100 * saves:.1f}% fewer replica-hours at {100 * best['sla_attainment']:.1f}%"
            if self.target.met(here)
            else f"the setting in force misses the target ({100 * here['sla_attainment']:.1f}%)"
        )
        chosen = Setting(**best["setting"])
        self.previous, self.predicted = self.current, best
        return self._apply(now, chosen, "apply", reason, best)

    def attainment(self, now: float, measured: list[RequestRecord]) -> float | None:
        """The share of the period's requests that met the SLO, counting those finished and
        those already past the TTFT objective without a first token (None: none of either)."""
        slo = self.target.slo
        known = {
            str(i): r
            for i, r in enumerate(measured)
            if r.finish_s is not None
            or (r.first_token_s is None and now - r.arrival_s > slo.ttft_s)
        }
        if not known:
            return None
        return summarize_records(known, slo, self.period_s)["sla_attainment"]

    def _revert(self, now: float, reason: str) -> Retune:
        assert self.previous is not None
        self.blocked[_key(self.current)] = now + self.tuning.cooldown_periods * self.period_s
        back = self.previous
        self.previous, self.predicted = None, None
        return self._apply(now, back, "revert", reason, None)

    def _apply(
        self,
        now: float,
        setting: Setting,
        kind: str,
        reason: str,
        predicted: dict[str, Any] | None,
    ) -> Retune:
        self.current = setting
        self.changes.append(TuningChange(now, kind, setting, reason, predicted))
        model, gpu, cost = self.replica
        fleet = setting.fleet(model, gpu, cost, self.target.slo)
        r = fleet.replica
        policy = partial(make_policy, r.policy, r.scheduler.max_num_seqs, r.memory_aware, r.sla)
        return Retune(policy, r.scheduler.max_num_batched_tokens, fleet.autoscale)


def tuned_fleet(
    setting: Setting, replica: tuple[ModelSpec, GpuSpec, CostParams], slo: Slo
) -> ClusterSimConfig:
    """The simulated deployment of `setting` with the controller on whatever its policy (so
    a retuner can change its policy while it runs)."""
    model, gpu, cost = replica
    return replace(setting.fleet(model, gpu, cost, slo), controller_interval_s=REPORT_INTERVAL_S)
