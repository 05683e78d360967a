"""Self-tuning of a deployed model (deploy.yaml `tuning.auto`), run by its cluster controller.

Every `period_s` the loop reads the model's rows of the app's traffic trace for the last
`window_s`, runs one AutoTuner step (cluster/tune/auto_tuner.py: the search on that window,
the revert check on the last period's rows) in a Ray task of `num_cpus` (the search is CPU
work; the controller's loop stays free), and when the tuner changes the setting, writes it
as the model's applied settings (cluster/live_settings.py), which the controller and the
autoscaling rule take within a second, as after POST /v1/cluster/settings. Settings an
operator applied meanwhile become the tuner's own (it goes on from them). Each change is
counted for /metrics (`dynabatch:tuning_applied_total`) and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import Any

import ray

from cluster import live_settings
from cluster.app_tables import Table
from cluster.live_settings import LiveSettings
from cluster.request_records import RequestRecord, Slo
from cluster.tune.auto_tuner import AutoTuner, AutoTuning, TuningChange
from cluster.tune.report import Target
from cluster.tune.space import Setting, Space
from cluster.workload import SimRequest

logger = logging.getLogger(__name__)


def window_requests(rows: list[dict[str, Any]], since: float) -> list[SimRequest]:
    """Trace rows that arrived at or after `since` as the simulator's requests (wall-clock
    arrivals; the tuner shifts a window to start at zero)."""
    return [
        SimRequest(
            row["request_id"],
            row["arrival_unix"],
            max(row["prompt_len"], 1),
            max(row["output_len"], 1),
            row.get("adapter"),
        )
        for row in rows
        if row["arrival_unix"] >= since
    ]


def measured_records(rows: list[dict[str, Any]], since: float) -> list[RequestRecord]:
    """Trace rows that arrived at or after `since` as what was measured of them: a rejected
    request never had a first token."""
    out = []
    for row in rows:
        arrival = row["arrival_unix"]
        if arrival < since:
            continue
        record = RequestRecord(arrival, row["prompt_len"], row["output_len"])
        if not row["rejected"] and row["ttft_s"] is not None:
            record.first_token_s = arrival + row["ttft_s"]
            record.finish_s = arrival + row["e2e_s"]
            record.num_output = row["output_len"]
        out.append(record)
    return out


def as_record(setting: Setting, plan: dict[str, Any], version: int, now: float) -> LiveSettings:
    """A tuner's Setting as the model's applied settings: the deployed batching and
    autoscaling knobs it does not set kept."""
    args = setting.deploy_args()
    batching = plan["batching"] | args["batching"]
    scaling = None
    if plan["autoscaling"] is not None:
        moved = {k: v for k, v in args.get("autoscaling", {}).items() if k != "initial_replicas"}
        scaling = plan["autoscaling"] | moved
    engine = args["engine"]
    return LiveSettings(
        plan["deployed"],
        version,
        now,
        engine["max_num_seqs"],
        engine["max_num_batched_tokens"],
        batching,
        scaling,
    )


def as_setting(applied: LiveSettings, base: Setting) -> Setting:
    """Applied settings (an operator's) as a tuner's Setting over `base`."""
    batching, scaling = applied.batching, applied.autoscaling or {}
    return Setting(
        **asdict(base)
        | {
            "policy": batching["policy"],
            "eta": batching["eta"],
            "sla_target_ms": batching["sla_target_ms"],
            "max_num_seqs": applied.max_num_seqs,
            "max_num_batched_tokens": applied.max_num_batched_tokens,
        }
        | {k: v for k, v in scaling.items() if k in asdict(base)}
    )


@ray.remote(max_retries=0)
def _step(
    tuner: AutoTuner, now: float, window: list[SimRequest], measured: list[RequestRecord]
) -> AutoTuner:
    tuner.retune(now, window, measured)
    return tuner


class TuningLoop:
    """One model's self-tuning: `plan` from serve_app.tuning_args.tuning_plan, `trace` the
    app's TrafficTrace table, `record_key` where the model's applied settings are kept."""

    def __init__(self, plan: dict[str, Any], trace: Table, record_key: str) -> None:
        self.plan, self.trace, self.record_key = plan, trace, record_key
        tuning = plan["tuning"]
        self.auto = AutoTuning(
            tuning["period_s"],
            tuning["window_s"],
            tuning["trials"],
            tuning["margin"],
            tuning["tolerance"],
            tuning["min_requests"],
            tuning["cooldown_periods"],
        )
        slo = Slo(tuning["ttft_s"], tuning["itl_s"], tuning["e2e_s"] or float("inf"))
        self.start = Setting(**plan["start"])
        self.tuner = AutoTuner(
            self.auto,
            Space.of(plan["space"], self.start),
            Target(slo, tuning["attainment"]),
            self._replica(plan["replica"]),
            self.start,
        )
        self.num_cpus = tuning["num_cpus"]
        self.version = 0  # of the applied settings this loop last wrote or adopted
        self.applied_total: dict[str, int] = {"apply": 0, "revert": 0}
        self.steps_total = 0
        self.failures_total = 0

    @staticmethod
    def _replica(replica: dict[str, Any]):
        from engine.runner.emulated_runner import emulated

        found = emulated(replica["model"], replica["gpu"], replica["calibration"])
        return found.model, found.gpu, found.params

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.auto.period_s)
            try:
                await self.step(time.time())
            except Exception:  # the trace or a node away: the next period tries again
                self.failures_total += 1
                logger.exception("self-tuning step failed")

    async def step(self, now: float) -> TuningChange | None:
        """One period: the tuner on the last window; its change, if any, applied."""
        in_force = await asyncio.to_thread(
            live_settings.read, self.record_key, self.plan["deployed"]
        )
        if in_force is not None and in_force.version != self.version:  # an operator's
            self.tuner.current, self.tuner.previous = as_setting(in_force, self.start), None
            self.version = in_force.version
        span = max(self.auto.window_s, self.auto.period_s)
        rows = await self.trace.rows.remote(now - span, now)
        rows = [row for row in rows if row["model"] == self.plan["model_name"]]
        window = window_requests(rows, now - self.auto.window_s)
        measured = measured_records(rows, now - self.auto.period_s)
        before = len(self.tuner.changes)
        task = _step.options(num_cpus=self.num_cpus).remote(self.tuner, now, window, measured)
        self.tuner = await task
        self.steps_total += 1
        if len(self.tuner.changes) == before:
            return None
        change = self.tuner.changes[-1]
        self.version += 1
        record = as_record(change.setting, self.plan, self.version, now)
        # NOTE: no await between the write and the count: whoever sees the record in force
        # sees it counted (a GCS put takes about a millisecond).
        live_settings.write(self.record_key, record)
        self.applied_total[change.kind] += 1
        logger.info("self-tuning %s (version %d): %s", change.kind, self.version, change.reason)
        return change

    def view(self) -> dict[str, Any]:
        """For /metrics and /v1/cluster: counts and the setting the tuner holds."""
        return {
            "applied_total": dict(self.applied_total),
            "steps_total": self.steps_total,
            "failures_total": self.failures_total,
            "setting": asdict(self.tuner.current),
            "version": self.version,
            "last_change": None
            if not self.tuner.changes
            else {
                "at": self.tuner.changes[-1].at_s,
                "kind": self.tuner.changes[-1].kind,
                "reason": self.tuner.changes[-1].reason,
            },
        }
