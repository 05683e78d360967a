"""The `args:` of deploy.yaml, validated at the edge: a typo is an error that names the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.deployment_args import (
    AutoscalingArgs,
    DisaggregationArgs,
    EngineReplicaArgs,
    ReplicaArgs,
    RoutingArgs,
    check_gpus_per_rank,
)
from serve_app.engine_args import EngineArgs
from serve_app.ingress.api_policy import ApiArgs
from serve_app.observability.tracing import TracingArgs
from serve_app.replica.health import HealthArgs
from serve_app.tuning_args import TuningArgs, tuning_plan


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchingArgs(_Strict):
    """The batch-size policy each engine replica applies between steps (cluster/batching.py)."""

    policy: Literal["static", "memory_aware", "sla", "combined"] = Field(
        "static",
        description="static: engine.max_num_seqs fixed. memory_aware: as many sequences as fit "
        "in eta of the KV cache. sla: keep decode-step latency at sla_target_ms. combined: the "
        "minimum of both. Dynamic policies start from engine.max_num_seqs.",
    )
    eta: float = Field(0.95, gt=0.0, le=1.0, description="memory_aware: share of KV to fill.")
    batch_size_lower: int = Field(1, ge=1, description="Least max_num_seqs a policy may set.")
    batch_size_upper: int = Field(256, ge=1, description="Most max_num_seqs a policy may set.")
    sla_target_ms: float = Field(50.0, gt=0.0, description="sla: decode-step latency target.")
    sla_eps_ms: float = Field(5.0, ge=0.0, description="sla: half-width of the target band.")
    sla_alpha: int = Field(4, ge=1, description="sla: least width of the search interval.")
    sla_delta: int = Field(4, ge=1, description="sla: how far a bound moves per correction.")
    sla_window: int = Field(16, ge=1, description="sla: decode-only steps averaged.")
    sla_max_step: int = Field(8, ge=0, description="sla: most change per update (0: no limit).")

    def make(self, max_num_seqs: int):
        return self.factory(max_num_seqs)()

    def factory(self, max_num_seqs: int):
        """A picklable no-argument callable that makes a fresh policy (one per replica)."""
        from cluster.batching import policy_factory

        return policy_factory(self.model_dump(), max_num_seqs)


class ControllerArgs(_Strict):
    """The cluster controller (cluster/controller.py): one per app, runs the batching policy
    of every engine replica from their periodic reports."""

    enabled: bool = Field(
        True,
        description="false: no controller; each engine replica runs its batching policy itself "
        "before every step, and GET /v1/cluster answers 503.",
    )
    report_interval_s: float = Field(
        0.5,
        gt=0.0,
        description="How often each engine replica reports and gets its limits, and pushes "
        "its metrics for /metrics (that push runs with the controller disabled too).",
    )
    report_timeout_s: float = Field(
        2.0, gt=0.0, description="A report not answered in this long fails; last limits stay."
    )
    stale_after_s: float = Field(
        5.0,
        gt=0.0,
        description="A replica silent this long drops out of the cluster view and /metrics.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources of the controller and the app's boards (engine "
        "metrics, LoRA adapters): the nodes they may run on.",
    )


class TrafficTraceArgs(_Strict):
    """deploy.yaml `trace:`: the app's record of its own traffic, a row per finished or
    rejected request (lengths and times, never text), for `python -m cluster.tune
    --from-url` (GET /v1/cluster/trace)."""

    enabled: bool = Field(True, description="Record the traffic.")
    max_rows: int = Field(100_000, ge=1, description="Most rows kept (the oldest go first).")
    max_age_s: float = Field(86_400.0, gt=0.0, description="Rows older than this go.")
    flush_s: float = Field(
        1.0,
        gt=0.0,
        description="How often an ingress replica sends its rows (a replica that dies loses "
        "at most the rows of this last interval).",
    )


class ModelEntry(_Strict):
    """One model of an app that serves several (`models:`), each with its own engine
    replicas, controller and LoRA adapters behind the app's ingress. Its fields are the
    top-level fields of the same names; a field it leaves out is the top level's, and a
    section it sets is merged over the top level's key by key (`engine: {dtype: bfloat16}`
    keeps the rest of the top-level `engine`)."""

    model: str = Field(description="As the top-level `model`.")
    served_model_name: str | None = Field(
        None, description="As the top-level one; unique among the app's models."
    )
    engine: dict[str, Any] = Field(
        default_factory=dict, description="Over the top-level `engine` (its `lora` included)."
    )
    batching: dict[str, Any] = Field(
        default_factory=dict, description="Over the top-level `batching`."
    )
    autoscaling: dict[str, Any] | None = Field(
        None, description="Over the top-level `autoscaling` (null here: a fixed count)."
    )
    engine_replicas: dict[str, Any] = Field(
        default_factory=dict, description="Over the top-level `engine_replicas`."
    )
    routing: dict[str, Any] = Field(
        default_factory=dict, description="Over the top-level `routing`."
    )
    max_queued_requests: int | None = Field(
        None, ge=0, description="As the top-level one. Null: the top level's."
    )
    delta_channels: bool | None = Field(
        None,
        description="As the top-level one, for this model's engine replicas. Null: the "
        "top level's.",
    )
    delta_links: bool | None = Field(
        None,
        description="As the top-level one (a model whose engine nodes take no other "
        "ports from the ingress's: false). Null: the top level's.",
    )

    def over(self, top: dict[str, Any]) -> dict[str, Any]:
        """The whole args of this model: what it sets over `top` (the app's args)."""
        patch = self.model_dump(exclude_unset=True)
        for inherited in ("max_queued_requests", "delta_channels", "delta_links"):
            if patch.get(inherited, 0) is None:
                del patch[inherited]
        return merged(top, patch)


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`patch` over `base`: a section set in both is merged key by key, anything else
    replaced."""
    out = dict(base)
    for key, value in patch.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if nested else value
    return out


class AppArgs(_Strict):
    """Everything `serve_app:build_app` needs; deploy.yaml's `args:`."""

    model: str | None = Field(
        None,
        description="The checkpoint (Llama, Mistral, Qwen2, Qwen3; Mixtral, Qwen2-MoE, Qwen3-MoE, "
        "gpt-oss: docs/models.md#architectures): a local HF checkpoint directory "
        "(the same path on every node), a Hugging Face Hub id (org/name; engine.revision picks "
        "the revision), or an object-store URI (s3://bucket/prefix/, gs://...). Each node "
        "fetches it once into its cache: docs/models.md. Required unless `models` is set.",
    )
    models: list[ModelEntry] = Field(
        default_factory=list,
        description="Several models behind one ingress, instead of `model`: each entry a "
        "model with its own engine replicas, controller and adapters; a request's `model` "
        "picks one (docs/serving.md#several-models). The top-level fields are the defaults of "
        "every entry.",
    )
    served_model_name: str | None = Field(
        None,
        description="Model id clients send in `model`. Null: a Hub id as it is, else the "
        "directory's (or the prefix's) last name.",
    )
    engine: EngineArgs = Field(default_factory=EngineArgs, description="Engine settings.")
    batching: BatchingArgs = Field(
        default_factory=BatchingArgs, description="Batch-size policy of every engine replica."
    )
    max_queued_requests: int = Field(
        64,
        ge=0,
        description="Requests an engine replica holds beyond a full batch (max_num_seqs); more "
        "are answered 429 with Retry-After.",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After (seconds) sent with a 429.")
    request_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="How long a request waits for an engine replica to take it: at its start "
        "while none answers, and after its replica died mid-stream (it then resumes at another "
        "from the tokens already sent). Past it, a stream ends with an error event and "
        "`data: [DONE]`, a whole response is a 503.",
    )
    stream_interval_s: float = Field(
        0.0,
        ge=0.0,
        description="Least time between two streamed chunks of one request: everything produced "
        "in between goes in one chunk. 0 sends a chunk after every engine step. The first token "
        "and the final chunk are never held back. Each chunk costs CPU across two "
        "Ray hops, so raise this where steps are short or cores are scarce.",
    )
    delta_channels: bool = Field(
        True,
        description="Carry every request's deltas from an engine replica to an ingress replica "
        "on one stream, one message per engine step for all of them (false: one message per "
        "request per step on the request's own handle call).",
    )
    delta_links: bool = Field(
        True,
        description="With delta_channels, an engine replica writes each step's batch to a TCP "
        "connection its ingress replica opened (to a free port of the engine's node) instead of "
        "a Ray message, which costs the ingress several times the CPU; a channel whose "
        "connection cannot be made stays on Ray, and one that breaks (or is cut off for 5 s) "
        "resumes its requests elsewhere, as when a replica dies.",
    )
    kv_transport: Literal["auto", "link", "object_store"] = Field(
        "auto",
        description="How a sequence's KV moves between engine replicas (a prefill replica's "
        "handoff, a stopping replica's moves): `link` straight from the replica it leaves to the "
        "one where it goes on (NCCL between GPUs, else a TCP connection to a free port of its "
        "node), `object_store` through Ray's object store (faster between CPU replicas on one "
        "node; where nodes let no other ports through), `auto` the link from a GPU's cache and "
        "the object store from a CPU's.",
    )
    api: ApiArgs = Field(default_factory=ApiArgs, description="What the OpenAI API lets in.")
    health: HealthArgs = Field(default_factory=HealthArgs, description="Engine replica health.")
    routing: RoutingArgs = Field(default_factory=RoutingArgs, description="Replica choice.")
    engine_replicas: EngineReplicaArgs = Field(
        default_factory=EngineReplicaArgs,
        description="Engine replicas (the GPU actors). With autoscaling, num_replicas is unused.",
    )
    controller: ControllerArgs = Field(
        default_factory=ControllerArgs, description="The cluster controller."
    )
    tracing: TracingArgs = Field(
        default_factory=TracingArgs, description="OpenTelemetry tracing of requests."
    )
    trace: TrafficTraceArgs = Field(
        default_factory=TrafficTraceArgs, description="The record of the app's traffic."
    )
    tuning: TuningArgs = Field(
        default_factory=TuningArgs,
        description="Self-tuning on the recorded traffic (off unless `auto`).",
    )
    autoscaling: AutoscalingArgs | None = Field(
        None, description="Scale engine replicas on queue depth. Null: engine_replicas is fixed."
    )
    ingress_replicas: ReplicaArgs = Field(
        default_factory=lambda: ReplicaArgs(num_cpus=0.5),
        description="OpenAI ingress replicas (tokenize, route, stream).",
    )
    disaggregation: DisaggregationArgs | None = Field(
        None,
        description="Separate prefill and decode pools for every model: each request "
        "prefills at a prefill replica and decodes at an engine replica, its KV moved "
        "between them. Null: each engine replica does both (chunked prefill).",
    )

    @model_validator(mode="after")
    def _check(self) -> AppArgs:
        if self.models:
            if self.model is not None:
                raise ValueError("model: set either `model` or `models`, not both")
            if self.served_model_name is not None:
                raise ValueError("served_model_name: with `models`, set in each entry")
            names: dict[str, int] = {}
            for index, args in enumerate(self.per_model()):  # each validated on its own
                if args.model_name in names:
                    raise ValueError(
                        f"models[{index}].served_model_name: {args.model_name!r} is also "
                        f"models[{names[args.model_name]}]'s"
                    )
                names[args.model_name] = index
            return self
        if self.model is None:
            raise ValueError("model: required (or `models`, a list)")
        check_gpus_per_rank(self.engine, self.engine_replicas, "engine_replicas", "engine")
        try:
            self.batching.factory(self.engine.max_num_seqs)
        except ValueError as exc:
            raise ValueError(f"batching: {exc}") from None
        self.emulated_label()  # a misspelt model or GPU fails the deploy, not the replicas
        if self.tuning.auto:
            if not self.trace.enabled or not self.controller.enabled:
                raise ValueError("tuning.auto: needs trace.enabled and controller.enabled")
            tuning_plan(self, "")  # a knob or value it cannot tune fails the deploy
        self.prefill_pool()  # a knob the prefill pool may not change fails the deploy
        return self

    @field_validator("model")
    @classmethod
    def _known_source(cls, model: str | None) -> str | None:
        from engine.model.model_source import source_kind

        if model is not None:
            source_kind(model)  # an unknown scheme fails the deploy, not the replicas
        return model

    def per_model(self) -> list[AppArgs]:
        """One model's whole args for each model the app serves: these args themselves when
        they name one `model`, else each `models` entry over the top-level fields."""
        if not self.models:
            return [self]
        top = self.model_dump(exclude={"models", "model", "served_model_name"})
        found = []
        for index, entry in enumerate(self.models):
            try:
                found.append(AppArgs.model_validate(entry.over(top)))
            except ValueError as exc:
                raise ValueError(f"models[{index}] ({entry.model}): {first_error(exc)}") from None
        return found

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        from engine.model.model_source import served_name

        if self.model is None:
            raise ValueError("model_name: these args serve several models (per_model())")
        return served_name(self.model)

    def check_sources(self) -> None:
        """That `model` and the draft model, where Hub ids or bucket URIs, can be fetched
        (without fetching them): a deploy fails at once, naming the field, rather than its
        replicas one by one. Raises InvalidParam."""
        from engine.model.model_source import check_source

        for args in self.per_model():
            engine, model = args.engine, args.model
            assert model is not None  # per_model's args each name one
            check_source(model, "model", engine.revision, engine.object_store_endpoint_url)
            draft = engine.speculative
            if draft.enabled and draft.model:
                endpoint = engine.object_store_endpoint_url
                check_source(draft.model, "engine.speculative.model", endpoint_url=endpoint)

    def with_local_model(self, weights: bool = True) -> AppArgs:
        """These args with `model` the checkpoint's directory on this node, fetched into its
        cache first where `model` is a Hub id or a bucket URI (once per node; `weights`
        false: all but the weights, as an ingress needs); the served name stays the
        source's. Raises InvalidParam naming `model` with the cause."""
        from engine.model.model_source import local_checkpoint

        engine = self.engine
        local = local_checkpoint(
            self.model, "model", engine.revision, engine.object_store_endpoint_url, weights
        )
        return self.model_copy(update={"model": local, "served_model_name": self.model_name})

    def emulated_label(self) -> str | None:
        """engine.device emulated: the model and GPU its replicas emulate ("Llama-3.1-8B on
        H100-80GB"); else None. Raises InvalidParam (a ValueError) naming a bad emulate knob."""
        if self.engine.device != "emulated":
            return None
        from engine.runner.emulated_runner import emulated

        emulate = self.engine.emulate
        return emulated(emulate.model, emulate.gpu, emulate.calibration).label

    @property
    def replica_capacity(self) -> int:
        """Requests one engine replica accepts at once: a full batch plus its queue."""
        return self.engine.max_num_seqs + self.max_queued_requests

    def prefill_pool(self) -> AppArgs | None:
        """With `disaggregation`, the args of the prefill pool's replicas: its engine knobs
        over `engine`, its replicas and autoscaling in place of the engine replicas'; else
        None. Raises ValueError naming a bad knob."""
        pool = self.disaggregation
        if pool is None or self.models:
            return None
        try:
            engine = EngineArgs.model_validate(
                merged(self.engine.model_dump(), pool.prefill_engine)
            )
        except ValueError as exc:
            raise ValueError(f"disaggregation.prefill_engine.{first_error(exc)}") from None
        replicas = "disaggregation.prefill_replicas"
        check_gpus_per_rank(engine, pool.prefill_replicas, replicas, "the prefill pool's engine")
        return self.model_copy(
            update={
                "engine": engine,
                "engine_replicas": pool.prefill_replicas,
                "autoscaling": pool.prefill_autoscaling,
            }
        )


def first_error(exc: ValueError) -> str:
    """A pydantic ValidationError's first message, its location named; another ValueError's
    text."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where and not message.startswith(where) else message
