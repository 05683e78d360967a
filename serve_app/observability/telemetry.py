"""GET /metrics: the HTTP-level metrics of the ingress replica that answers, then the engine
replicas' metrics as the metrics board last heard them (the whole deployment, whichever
ingress replica answers; serve_app/observability/metrics_board.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from serve_app.transport.engine_client import EngineClient

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class IngressMetrics:
    """Counters and latency histograms of every model the ingress serves (each model's
    through its ModelMetrics); each instance owns its registry (no globals)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dynabatch_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["model", "endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "dynabatch_prompt_tokens",
            "Prompt tokens of accepted requests.",
            ["model"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "dynabatch_generation_tokens", "Tokens generated.", ["model"], registry=self.registry
        )
        self.finished = Counter(
            "dynabatch_requests_finished",
            "Requests the engine ended, by finish reason (stop, length, abort, error).",
            ["model", "finish_reason"],
            registry=self.registry,
        )
        self.resumed = Counter(
            "dynabatch_sequences_resumed",
            "Sequences resumed at another engine replica after theirs failed mid-stream.",
            ["model"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "dynabatch_time_to_first_token_seconds",
            "Time to first token.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "dynabatch_e2e_request_latency_seconds",
            "Request latency, first byte in to last out.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._paths = _PathCollector()
        self.registry.register(self._paths)

    def model(self, model_name: str) -> ModelMetrics:
        return ModelMetrics(self, model_name)

    def watch_path(self, client: EngineClient) -> None:
        """Export what the path to a model's engine replicas counts (serve_app/transport),
        summed over the models."""
        self._paths.clients.append(client)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's share of the ingress's metrics: its `model` label."""

    def __init__(self, metrics: IngressMetrics, model_name: str) -> None:
        self.metrics, self.model_name = metrics, model_name

    def sequence_resumed(self) -> None:
        self.metrics.resumed.labels(self.model_name).inc()

    def answered(self, endpoint: str, status: int) -> None:
        self.metrics.requests.labels(self.model_name, endpoint, str(status)).inc()

    def completed(
        self,
        prompt_tokens: int,
        output_tokens: int,
        finish_reason: str | None,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        m, metrics = self.model_name, self.metrics
        metrics.prompt_tokens.labels(m).inc(prompt_tokens)
        metrics.generation_tokens.labels(m).inc(output_tokens)
        metrics.finished.labels(m, finish_reason or "abort").inc()
        if ttft_s is not None:
            metrics.ttft.labels(m).observe(ttft_s)
        metrics.e2e.labels(m).observe(e2e_s)


# (counter, its description, the attribute summed, whether of the delta channels)
_PATH_COUNTERS = (
    ("engine_calls_direct", "Engine calls sent to the chosen replica's actor directly.",
     "num_direct_calls", False),
    ("engine_calls_routed", "Engine calls sent through Serve's handle.", "num_handle_calls",
     False),
    ("engine_calls_on_links", "Engine calls sent on the chosen replica's delta link.",
     "num_link_calls", False),
    ("sequences_handed_on", "Sequences moved with their KV from a prefill replica to a decode "
     "replica (disaggregation).", "num_handed_on", False),
    ("channel_messages", "Delta channel messages taken.", "num_messages", True),
    ("channel_deltas", "Request deltas those messages held.", "num_deltas", True),
    ("response_wakeups", "Wake-ups of streamed responses for deltas.", "num_wakeups", True),
    ("delta_links_lost", "Delta links that broke with requests open (those resumed).",
     "num_links_lost", True),
)  # fmt: skip


class _PathCollector:
    """What the streaming path costs: engine calls sent to a replica's actor directly and
    through Serve's handle; per engine step, the channel messages the ingress took (a Ray
    message or a delta link's frame: at most one per engine step per engine replica), the
    deltas in them, and the wake-ups of the responses that read them (at most one per
    response per step: never one per token); delta links that broke. Summed over the models'
    engine clients."""

    def __init__(self) -> None:
        self.clients: list[EngineClient] = []

    def collect(self):
        channels = [client.channels for client in self.clients if client.channels is not None]
        for name, doc, attribute, of_channels in _PATH_COUNTERS:
            if of_channels and not channels:
                continue
            sources = channels if of_channels else self.clients
            family = CounterMetricFamily(f"dynabatch_ingress_{name}", doc)
            family.add_metric([], sum(getattr(source, attribute) for source in sources))
            yield family


# ------------------------------------------------------------------- engine replicas
def _histogram(name: str, doc: str, rows) -> HistogramMetricFamily:
    """rows: (label values, HistogramSnapshot); Prometheus wants cumulative buckets."""
    family = HistogramMetricFamily(name, doc, labels=["model_name", "replica"])
    for labels, snap in rows:
        if snap is None:
            continue
        cumulative, buckets = 0, []
        for bound, count in zip((*snap.bounds, float("inf")), snap.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        family.add_metric(labels, buckets, snap.total)
    return family


class _EngineCollector:
    """The deployment's engine replicas as the metrics board last heard them, with the
    metric names vLLM uses (prefix `dynabatch:` where vLLM has `vllm:`)."""

    def __init__(self, latest) -> None:
        self.latest = latest

    def collect(self):
        rows = [((m, stats.replica_id), stats, decision) for m, stats, decision in self.latest]
        gauges = {
            "num_requests_running": (
                "Requests in the running batch.",
                lambda s, d: s.scheduler.num_running,
            ),
            "num_requests_waiting": (
                "Requests accepted and not running.",
                lambda s, d: s.num_waiting,
            ),
            "kv_cache_usage_perc": (
                "KV cache usage (1 = full).",
                lambda s, d: s.scheduler.kv_usage,
            ),
            "max_num_seqs": (
                "The batch limit the policy set now.",
                lambda s, d: d.limits.max_num_seqs,
            ),
            "routing_weight": (
                "The controller's routing weight (below 1: throttled).",
                lambda s, d: d.routing_weight,
            ),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"dynabatch:{name}", doc, labels=["model_name", "replica"])
            for labels, stats, decision in rows:
                family.add_metric(labels, float(value(stats, decision)))
            yield family
        replicas = GaugeMetricFamily(
            "dynabatch:num_engine_replicas", "Engine replicas reporting.", labels=["model_name"]
        )
        for model in sorted({m for m, _, _ in self.latest}):
            replicas.add_metric([model], float(sum(m == model for m, _, _ in self.latest)))
        yield replicas
        info = GaugeMetricFamily(
            "dynabatch:attention_backend_info",
            "The attention kernels each engine replica runs, and why (always 1).",
            labels=["model_name", "replica", "backend", "reason"],
        )
        for labels, stats, _ in rows:
            if stats.attention_kernels:
                info.add_metric(
                    [*labels, stats.attention_kernels, stats.attention_kernels_reason], 1.0
                )
        yield info
        cache = GaugeMetricFamily(
            "dynabatch:cache_config_info",
            "The KV cache of each engine replica: tokens per block, blocks, and what a value "
            "is stored as (always 1).",
            labels=["model_name", "replica", "block_size", "num_gpu_blocks", "cache_dtype"],
        )
        for labels, stats, _ in rows:
            if stats.cache_dtype:
                blocks = str(stats.scheduler.num_total_blocks)
                cache.add_metric([*labels, str(stats.kv_block_size), blocks, stats.cache_dtype], 1)
        yield cache
        checks = GaugeMetricFamily(
            "dynabatch:gpu_self_check_info",
            "Each GPU kernel part the start-up self-check ran, its result (pass, or fallback "
            "to the torch reference) and the reason (always 1).",
            labels=["model_name", "replica", "part", "result", "reason"],
        )
        for labels, stats, _ in rows:
            for part, result, reason in stats.self_check_verdicts:
                checks.add_metric([*labels, part, result, reason], 1.0)
        yield checks
        loras = GaugeMetricFamily(
            "dynabatch:lora_requests_info",
            "LoRA adapters of each engine replica (vLLM's lora_requests_info): its slots and "
            "the adapters of its running and waiting requests (always 1).",
            labels=[
                "model_name",
                "replica",
                "max_lora",
                "running_lora_adapters",
                "waiting_lora_adapters",
            ],
        )
        for labels, stats, _ in rows:
            sched = stats.scheduler
            if sched.max_loras:
                running, waiting = ",".join(sched.running_loras), ",".join(sched.waiting_loras)
                loras.add_metric([*labels, str(sched.max_loras), running, waiting], 1.0)
        yield loras
        counters = {
            "num_preemptions": ("Preemptions.", lambda s: s.scheduler.num_preemptions_total),
            "prompt_tokens": (
                "Prompt tokens of finished requests.",
                lambda s: s.metrics.prompt_tokens_total,
            ),
            "generation_tokens": (
                "Generated tokens of finished requests.",
                lambda s: s.metrics.generation_tokens_total,
            ),
            "num_rejected": ("Requests answered 429.", lambda s: s.num_rejected_total),
            "prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                lambda s: s.scheduler.prefix_cache_queries,
            ),
            "prefix_cache_hits": (
                "Prompt tokens found in the prefix cache.",
                lambda s: s.scheduler.prefix_cache_hits,
            ),
        }
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(f"dynabatch:{name}", doc, labels=["model_name", "replica"])
            for labels, stats, _ in rows:
                if stats.metrics is not None or name not in ("prompt_tokens", "generation_tokens"):
                    family.add_metric(labels, float(value(stats)))
            yield family
        yield from _spec_decode_families(rows)
        success = CounterMetricFamily(
            "dynabatch:request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "replica", "finished_reason"],
        )
        for labels, stats, _ in rows:
            for reason, n in (stats.metrics.finished_total if stats.metrics else {}).items():
                success.add_metric([*labels, reason], float(n))
        yield success
        hists = {
            "time_to_first_token_seconds": ("Time to first token at the engine.", "ttft"),
            "inter_token_latency_seconds": ("Time between streamed tokens.", "itl"),
            "e2e_request_latency_seconds": ("Request latency at the engine.", "e2e"),
            "request_queue_time_seconds": ("Arrival to first scheduled.", "queue_time"),
            "iteration_batch_size": ("Requests per engine step.", "batch_size"),
        }
        for name, (doc, attr) in hists.items():
            yield _histogram(
                f"dynabatch:{name}",
                doc,
                [(labels, getattr(s.metrics, attr)) for labels, s, _ in rows if s.metrics],
            )


def _spec_decode_families(rows):
    """Speculative decoding's counters, as vLLM's spec_decode_* (replicas that speculate)."""
    counters = {
        "num_drafts": "Rows whose drafts were verified.",
        "num_draft_tokens": "Draft tokens verified.",
        "num_accepted_tokens": "Draft tokens accepted.",
    }
    speculating = [(labels, s.scheduler.spec) for labels, s, _ in rows if s.scheduler.spec]
    for name, doc in counters.items():
        family = CounterMetricFamily(
            f"dynabatch:spec_decode_{name}", doc, labels=["model_name", "replica"]
        )
        for labels, spec in speculating:
            family.add_metric(labels, float(getattr(spec, name)))
        yield family
    per_position = CounterMetricFamily(
        "dynabatch:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the draft (0: first).",
        labels=["model_name", "replica", "position"],
    )
    for labels, spec in speculating:
        for position, n in enumerate(spec.accepted_per_position):
            per_position.add_metric([*labels, str(position)], float(n))
    yield per_position


def render_engine_metrics(latest) -> bytes:
    """Prometheus text for the engine replicas (`latest`: each replica's model name and last
    (stats, decision) pair)."""
    registry = CollectorRegistry()
    registry.register(_EngineCollector(latest))
    return generate_latest(registry)
