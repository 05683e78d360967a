"""Prometheus metrics of one ingress replica, served as text at GET /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class IngressMetrics:
    """Counters and latency histograms; each instance owns its registry (no globals)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
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

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(self.model_name, endpoint, str(status)).inc()

    def completed(
        self,
        prompt_tokens: int,
        output_tokens: int,
        finish_reason: str | None,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        self.finished.labels(m, finish_reason or "abort").inc()
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        self.e2e.labels(m).observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
