"""What the tuner searches: a Setting (the knobs of one deployment), the grid of values each
knob may take, the simulated fleet a Setting makes, and the deploy.yaml `args:` it is.

A Setting's dynamic batching policies run as the deployed app runs them, in the cluster
controller (ClusterSimConfig.controller_interval_s = controller.report_interval_s), with
the bounds and targets BatchingArgs gives them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Container
from dataclasses import dataclass, fields, replace
from typing import Any

from cluster.autoscale import AutoscaleConfig
from cluster.batching import Bounds, MemoryAwareConfig, SlaConfig
from cluster.cluster_sim import ClusterSimConfig
from cluster.request_records import Slo
from cluster.sim_config import SimConfig
from engine.core.config import SchedulerConfig
from engine.runner.cost_model import CostParams, GpuSpec, ModelSpec

POLICIES = ("static", "memory_aware", "sla", "combined")
REPORT_INTERVAL_S = 0.5  # controller.report_interval_s's default
BATCH_SIZE_UPPER = 256  # batching.batch_size_upper's default
SLA_EPS_MS = 5.0  # batching.sla_eps_ms's default
ENGINE_DEFAULTS = SchedulerConfig()  # the engine's knobs as deploy.yaml's engine: has them


@dataclass(frozen=True)
class Setting:
    """One deployment's knobs. `autoscale` False: a fixed fleet of `replicas`."""

    policy: str = "static"
    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens
    eta: float = 0.95
    sla_target_ms: float = 50.0
    autoscale: bool = True
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 8
    initial_replicas: int = 0  # at the start (0: min_replicas)
    target_waiting: float = 4.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    startup_delay_s: float = 60.0  # how long a new replica takes to serve (a given, or searched)

    def check(self) -> None:
        """ValueError naming the knob that cannot be deployed."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy: one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.replicas < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and replicas must be >= 1")
        if self.autoscale:
            try:
                self.rule()
            except ValueError as exc:
                raise ValueError(f"autoscaling: {exc}") from None
            if self.initial_replicas and not (
                self.min_replicas <= self.initial_replicas <= self.max_replicas
            ):
                raise ValueError("initial_replicas: within min_replicas and max_replicas")

    def rule(self) -> AutoscaleConfig:
        return AutoscaleConfig(
            self.min_replicas,
            self.max_replicas,
            target_waiting=self.target_waiting,
            upscale_delay_s=self.upscale_delay_s,
            downscale_delay_s=self.downscale_delay_s,
        )

    def fleet(self, model: ModelSpec, gpu: GpuSpec, cost: CostParams, slo: Slo) -> ClusterSimConfig:
        """The simulated deployment of this setting."""
        bounds = Bounds(1, max(BATCH_SIZE_UPPER, self.max_num_seqs))
        replica = SimConfig(
            model,
            gpu,
            policy=self.policy,  # type: ignore[arg-type]
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=4096,
            ),
            cost=cost,
            memory_aware=MemoryAwareConfig(self.eta, bounds),
            sla=SlaConfig(self.sla_target_ms / 1e3, SLA_EPS_MS / 1e3, bounds=bounds),
            slo=slo,
        )
        return ClusterSimConfig(
            replica,
            self.rule() if self.autoscale else None,
            (self.initial_replicas or self.min_replicas) if self.autoscale else self.replicas,
            startup_delay_s=self.startup_delay_s,
            controller_interval_s=None if self.policy == "static" else REPORT_INTERVAL_S,
        )

    def deploy_args(self) -> dict[str, Any]:
        """This setting as deploy.yaml's `args:` (the keys it sets; serve_app.config.AppArgs)."""
        batching: dict[str, Any] = {"policy": self.policy}
        if self.policy in ("memory_aware", "combined"):
            batching["eta"] = self.eta
        if self.policy in ("sla", "combined"):
            batching["sla_target_ms"] = self.sla_target_ms
        if self.max_num_seqs > BATCH_SIZE_UPPER:
            batching["batch_size_upper"] = self.max_num_seqs
        args: dict[str, Any] = {
            "engine": {
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
            },
            "batching": batching,
        }
        if self.autoscale:
            args["autoscaling"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_waiting": self.target_waiting,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
            }
            if self.initial_replicas:
                args["autoscaling"]["initial_replicas"] = self.initial_replicas
        else:
            args["engine_replicas"] = {"num_replicas": self.replicas}
        return args


KNOBS = {f.name: f.type for f in fields(Setting)}

# What `cluster.tune` searches when told nothing: the knobs users most often get wrong.
DEFAULT_SPACE: dict[str, list[Any]] = {
    "policy": ["static", "combined"],
    "max_num_seqs": [64, 128, 256],
    "target_waiting": [2.0, 4.0, 8.0],
    "upscale_delay_s": [5.0, 10.0, 30.0],
    "downscale_delay_s": [30.0, 60.0, 180.0],
}


def parse_knob(text: str) -> tuple[str, list[Any]]:
    """`name=v1,v2,...` -> (name, values), each value of the knob's type."""
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in KNOBS:
        raise ValueError(f"--set {text!r}: expected NAME=V1,V2,... with NAME one of {list(KNOBS)}")
    kind = KNOBS[name]
    out: list[Any] = []
    for raw in values.split(","):
        raw = raw.strip()
        try:
            if kind == "bool":
                if raw.lower() not in ("true", "false"):
                    raise ValueError(raw)
                out.append(raw.lower() == "true")
            else:
                out.append({"int": int, "float": float, "str": str}[kind](raw))
        except ValueError:
            raise ValueError(f"--set {name}: {raw!r} is not a {kind}") from None
    return name, out


@dataclass(frozen=True)
class Space:
    """Each knob's values in order (one value: fixed; the rest of Setting: `base`'s)."""

    values: dict[str, tuple[Any, ...]]
    base: Setting = Setting()

    @classmethod
    def of(cls, knobs: dict[str, list[Any]], base: Setting | None = None) -> Space:
        return cls({k: tuple(v) for k, v in knobs.items()}, base or Setting())

    @property
    def size(self) -> int:
        n = 1
        for v in self.values.values():
            n *= len(v)
        return n

    def setting(self, point: tuple[int, ...]) -> Setting:
        """The Setting at a point (one index per knob)."""
        chosen = {k: v[i] for (k, v), i in zip(self.values.items(), point, strict=True)}
        return replace(self.base, **chosen)

    def points(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(len(v)) for v in self.values.values())))

    def sample(
        self, n: int, rng: random.Random, exclude: Container[tuple[int, ...]] = ()
    ) -> list[tuple[int, ...]]:
        """`n` distinct points at random, none of `exclude` (all the others if the grid
        holds no more)."""
        every = [p for p in self.points() if p not in exclude]
        return every if len(every) <= n else rng.sample(every, n)

    def neighbours(self, point: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The points one grid step away along one knob."""
        out = []
        for axis, size in enumerate(len(v) for v in self.values.values()):
            for step in (-1, 1):
                i = point[axis] + step
                if 0 <= i < size:
                    out.append(point[:axis] + (i,) + point[axis + 1 :])
        return out
