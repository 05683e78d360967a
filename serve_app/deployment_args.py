"""The deployments' sections of deploy.yaml's `args:`: how many engine replicas, with what
resources, scaled by what rule, chosen by the ingress how, and the prefill pool beside them
(serve_app/config.py holds the whole)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.engine_args import EngineArgs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingArgs(_Strict):
    """Engine replica count from queue depth (cluster/autoscale.py), through Ray Serve's
    autoscaler. The rule keeps its own delays; Serve's are set to 0."""

    min_replicas: int = Field(1, ge=1, description="Fewest engine replicas.")
    max_replicas: int = Field(4, ge=1, description="Most engine replicas.")
    initial_replicas: int | None = Field(None, ge=1, description="At start. Null: min_replicas.")
    target_waiting: float = Field(
        4.0, gt=0.0, description="Scale up when the mean waiting requests per replica exceed this."
    )
    upscale_kv_usage: float = Field(
        0.9, gt=0.0, le=1.0, description="...or when the mean KV cache usage exceeds this."
    )
    downscale_waiting: float = Field(
        0.5, ge=0.0, description="Scale down only when mean waiting per replica is at most this."
    )
    downscale_utilization: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="...and the running requests fit in one replica fewer at this share of "
        "their max_num_seqs.",
    )
    upscale_delay_s: float = Field(
        10.0, ge=0.0, description="How long the up condition must hold without a break."
    )
    downscale_delay_s: float = Field(
        60.0, ge=0.0, description="How long the down condition must hold without a break."
    )
    metrics_interval_s: float = Field(
        1.0, gt=0.0, description="How often each replica pushes its queue metrics to Serve."
    )
    look_back_period_s: float = Field(
        2.0, gt=0.0, description="Serve averages each replica's metrics over this window."
    )

    def rule_config(self) -> dict[str, Any]:
        """The keyword arguments of cluster.autoscale.AutoscaleConfig (Serve's policy_kwargs)."""
        return self.model_dump(
            exclude={"initial_replicas", "metrics_interval_s", "look_back_period_s"}
        )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingArgs:
        from cluster.autoscale import AutoscaleConfig

        AutoscaleConfig(**self.rule_config())
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("look_back_period_s must be greater than metrics_interval_s")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError("initial_replicas must be within min_replicas and max_replicas")
        return self


class RoutingArgs(_Strict):
    """How the ingress picks an engine replica for each request."""

    prefix_affinity: bool = Field(
        True,
        description="Send requests whose prompts share their first prefix_tokens tokens to the "
        "same replica (its KV cache is warm for them), unless it is much busier than the others.",
    )
    prefix_tokens: int = Field(
        64, ge=1, description="How many leading prompt tokens define the affinity key."
    )
    max_imbalance: int = Field(
        8,
        ge=0,
        description="Affinity yields to least-loaded routing when the preferred replica has this "
        "many more outstanding requests than the least loaded one.",
    )
    kv_aware: bool = Field(
        False,
        description="Route by what each replica holds: the replicas publish the keys of the "
        "prompt blocks in their KV cache every second, and each replica's outstanding "
        "requests count less by kv_weight times the share of the prompt it holds and more by "
        "kv_weight times the share of its cache that cached blocks fill; a prefix that as "
        "many prompts continued differently as there are replicas counts as held by all (in "
        "place of prefix_affinity's hash of the first prefix_tokens tokens; adapter requests "
        "are routed by adapter).",
    )
    kv_weight: float = Field(
        8.0,
        ge=0.0,
        description="With kv_aware: how many outstanding requests a replica holding the whole "
        "prompt in its cache is worth (one holding half of it, half as many).",
    )


class ReplicaArgs(_Strict):
    """Replica count and Ray resources of one deployment."""

    num_replicas: int = Field(1, ge=1, description="Fixed replica count.")
    num_cpus: float = Field(1.0, ge=0.0, description="Ray logical CPUs per replica.")
    num_gpus: float = Field(
        0.0,
        ge=0.0,
        description="GPUs per replica (0 on CPU machines; engines: tensor_parallel_size, one "
        "per rank, each rank's share of the replica's resources a bundle of its placement "
        "group, all on one node).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources per replica: replicas go only to nodes that offer "
        "them (`ray start --resources='{\"engine_node\": 1}'`), so a cluster's layout is "
        "deploy.yaml's to choose.",
    )


class EngineReplicaArgs(ReplicaArgs):
    """Replica count and Ray resources of the engine replicas."""

    num_cpus: Annotated[float, Field(ge=0.0)] | Literal["auto"] = Field(
        "auto",
        description="Ray logical CPUs per replica. auto: on the CPU the cores the engine's "
        "threads use (engine.num_threads, else every core), at most what the largest node has "
        "left after the ingress replicas, so no other engine replica is placed onto busy cores "
        "and autoscaling stops at the replicas that fit; emulated: 0; on a GPU: 1.",
    )


# Engine knobs a prefill pool may set apart from the decode pool: how it batches, caches and
# runs, never what its KV or its first token is.
PREFILL_ENGINE_KNOBS = frozenset(
    {
        "max_num_seqs",
        "max_num_batched_tokens",
        "batching",
        "scheduling_policy",
        "aging_s",
        "preemption_mode",
        "num_blocks",
        "kv_cache_bytes",
        "gpu_memory_fraction",
        "enable_prefix_caching",
        "num_host_blocks",
        "swap_space_bytes",
        "enforce_eager",
        "overlap_steps",
        "num_threads",
        "speculative",
        # The KV leaves a replica with every head, whatever its ranks.
        "tensor_parallel_size",
    }
)


class DisaggregationArgs(_Strict):
    """Prefill and decode on separate engine replicas (docs/cluster.md, "Disaggregated
    prefill and decode"): a request's prompt is computed at a prefill replica, which sends
    its first token and then moves the sequence, with the prompt's KV, to a decode replica
    (`engine_replicas`, autoscaled as configured), where it decodes."""

    prefill_replicas: EngineReplicaArgs = Field(
        default_factory=lambda: EngineReplicaArgs(num_replicas=1),
        description="The prefill pool's replicas (num_replicas unused with "
        "prefill_autoscaling); num_cpus auto as for engine_replicas.",
    )
    prefill_engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Over `engine` for the prefill pool, key by key: its batch and cache "
        f"knobs ({', '.join(sorted(PREFILL_ENGINE_KNOBS))}). The rest (the model, dtype, "
        "block size, KV dtype, context length) stay the decode pool's: its KV must be theirs.",
    )
    prefill_autoscaling: AutoscalingArgs | None = Field(
        None,
        description="Scale the prefill pool on its queue depth, as `autoscaling` the engine "
        "replicas. Null: prefill_replicas.num_replicas, fixed.",
    )

    @field_validator("prefill_engine")
    @classmethod
    def _prefill_knobs(cls, knobs: dict[str, Any]) -> dict[str, Any]:
        for name in knobs:
            if name not in PREFILL_ENGINE_KNOBS:
                raise ValueError(
                    f"{name}: not a knob the prefill pool sets apart from the decode pool "
                    f"(one of {', '.join(sorted(PREFILL_ENGINE_KNOBS))})"
                )
        return knobs


def check_gpus_per_rank(
    engine: EngineArgs, replicas: EngineReplicaArgs, replicas_name: str, engine_name: str
) -> None:
    """One GPU per tensor-parallel rank, all on the replica's node: else ValueError naming
    the fields."""
    tp, gpus = engine.tensor_parallel_size, replicas.num_gpus
    if tp > 1 and gpus and gpus != tp:
        raise ValueError(
            f"{replicas_name}.num_gpus ({gpus:g}) must equal {tp}, "
            f"{engine_name}.tensor_parallel_size"
        )
