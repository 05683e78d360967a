"""deploy.yaml `tuning:`: self-tuning, opt-in. The model's cluster controller tunes on the
last window of the app's recorded traffic every period (cluster/tuning_loop.py, the
AutoTuner of cluster/tune/auto_tuner.py) and applies a setting as POST
/v1/cluster/settings would."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# The knobs self-tuning may move: those settings applied live change (serve_app/ingress/
# settings_routes.py), named as cluster.tune's --set names them.
TUNABLE = (
    "policy",
    "max_num_seqs",
    "max_num_batched_tokens",
    "eta",
    "sla_target_ms",
    "min_replicas",
    "max_replicas",
    "target_waiting",
    "upscale_delay_s",
    "downscale_delay_s",
)


class TuningArgs(BaseModel):
    """deploy.yaml `tuning:`: self-tuning, off unless `auto`. Each model's cluster controller
    tunes on the last `window_s` of the app's recorded traffic every `period_s` (the
    simulator, a replica priced by `replica_model` on `replica_gpu` or `calibration`) and
    applies the cheapest setting of `space` that meets the SLO when it saves `margin` of the
    replica-hours (or the setting in force misses it); it reverts a change whose measured
    attainment falls `tolerance` under the predicted (docs/cluster.md, "Self-tuning")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    auto: bool = Field(
        False,
        description="Tune batching and autoscaling on the app's own recorded traffic and apply "
        "what the simulator predicts is cheaper within the SLO (needs trace and the "
        "controller on).",
    )
    period_s: float = Field(600.0, gt=0.0, description="How often it tunes.")
    window_s: float = Field(1800.0, gt=0.0, description="The traffic it tunes on: this last.")
    trials: int = Field(12, ge=1, description="Simulated runs of settings per tuning.")
    margin: float = Field(
        0.05, ge=0.0, lt=1.0, description="The least share of replica-hours a change must save."
    )
    tolerance: float = Field(
        0.02,
        ge=0.0,
        description="Measured SLO attainment this far under the predicted reverts a change.",
    )
    min_requests: int = Field(50, ge=1, description="A window with fewer decides nothing.")
    cooldown_periods: int = Field(
        3, ge=0, description="Periods a reverted setting is not applied again."
    )
    ttft_s: float = Field(2.0, gt=0.0, description="The SLO: time to first token.")
    itl_s: float = Field(0.1, gt=0.0, description="The SLO: inter-token latency.")
    e2e_s: float | None = Field(None, gt=0.0, description="The SLO: end to end (null: none).")
    attainment: float = Field(
        0.9, gt=0.0, le=1.0, description="The share of requests that must meet the SLO."
    )
    space: dict[str, list[Any]] = Field(
        default_factory=lambda: {
            "policy": ["static", "combined"],
            "target_waiting": [2.0, 4.0, 8.0],
            "upscale_delay_s": [5.0, 10.0, 30.0],
            "downscale_delay_s": [30.0, 60.0, 180.0],
        },
        description="The grid it searches, the operator's bounds (knobs as cluster.tune "
        f"--set names them: {', '.join(TUNABLE)}); each value within what settings applied "
        "live accept.",
    )
    replica_model: str | None = Field(
        None,
        description="The replica's cost model by name from the simulator's tables (null: "
        "engine.emulate's where the app is emulated).",
    )
    replica_gpu: str | None = Field(None, description="Its GPU, likewise.")
    calibration: str | None = Field(
        None, description="A `python -m loadtests.calibrate` JSON instead of model and GPU."
    )
    startup_delay_s: float = Field(
        60.0, ge=0.0, description="How long a new engine replica takes to serve."
    )
    num_cpus: float = Field(
        1.0,
        ge=0.0,
        description="CPUs the background tuning task reserves in Ray (0: none; it still "
        "takes one while it runs).",
    )


def tuning_plan(args: Any, deployed_fingerprint: str) -> dict[str, Any]:
    """What a model's controller needs to tune it (plain data): `args` its AppArgs with
    `tuning.auto` on. Raises ValueError naming a knob or value it cannot tune."""
    from cluster.tune.space import KNOBS, Space

    tuning: TuningArgs = args.tuning
    for knob, values in tuning.space.items():
        if knob not in KNOBS:
            raise ValueError(f"tuning.space.{knob}: one of {', '.join(TUNABLE)}")
        if knob not in TUNABLE:
            raise ValueError(f"tuning.space.{knob}: changes only with a redeploy")
        if not isinstance(values, list) or not values:
            raise ValueError(f"tuning.space.{knob}: a non-empty list of values")
    emulate = args.engine.emulate
    model = tuning.replica_model or (emulate.model if args.engine.device == "emulated" else None)
    gpu = tuning.replica_gpu or (emulate.gpu if args.engine.device == "emulated" else None)
    calibration = tuning.calibration or (
        emulate.calibration if args.engine.device == "emulated" else None
    )
    if not calibration and (model is None or gpu is None):
        raise ValueError("tuning.replica_model: needed (and replica_gpu, or calibration)")
    start = start_setting(args, tuning.startup_delay_s)
    space = Space.of(tuning.space, start)
    ceiling = max(args.engine.max_num_seqs, args.batching.batch_size_upper)
    scaling = args.autoscaling
    for point in space.points():
        setting = space.setting(point)
        try:
            setting.check()
        except ValueError as exc:
            raise ValueError(f"tuning.space: {exc}") from None
        if setting.max_num_seqs > ceiling:
            raise ValueError(f"tuning.space.max_num_seqs: at most {ceiling}")
        budget = args.engine.max_num_batched_tokens
        if setting.max_num_batched_tokens > budget:
            raise ValueError(f"tuning.space.max_num_batched_tokens: at most {budget}")
        if scaling is not None and not (
            scaling.min_replicas <= setting.min_replicas <= scaling.max_replicas
            and setting.max_replicas <= scaling.max_replicas
        ):
            raise ValueError(
                "tuning.space: min_replicas and max_replicas within the deployed "
                f"{scaling.min_replicas}..{scaling.max_replicas}"
            )
    return {
        "model_name": args.model_name,
        "deployed": deployed_fingerprint,
        "start": asdict(start),
        "space": dict(tuning.space),
        "tuning": tuning.model_dump(),
        "replica": {"model": model, "gpu": gpu, "calibration": calibration},
        "batching": args.batching.model_dump(),
        "autoscaling": args.autoscaling.rule_config() if args.autoscaling else None,
    }


def start_setting(args: Any, startup_delay_s: float):
    """The deployed args as the tuner's Setting."""
    from cluster.tune.space import Setting

    scaling = args.autoscaling
    common = {
        "policy": args.batching.policy,
        "max_num_seqs": args.engine.max_num_seqs,
        "max_num_batched_tokens": args.engine.max_num_batched_tokens,
        "eta": args.batching.eta,
        "sla_target_ms": args.batching.sla_target_ms,
        "startup_delay_s": startup_delay_s,
    }
    if scaling is None:
        return Setting(autoscale=False, replicas=args.engine_replicas.num_replicas, **common)
    return Setting(
        min_replicas=scaling.min_replicas,
        max_replicas=scaling.max_replicas,
        target_waiting=scaling.target_waiting,
        upscale_delay_s=scaling.upscale_delay_s,
        downscale_delay_s=scaling.downscale_delay_s,
        **common,
    )
