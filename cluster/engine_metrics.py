"""Request-level metrics of one engine replica, as cumulative counters and histograms.

Each EngineServer keeps an EngineMetrics and sends its snapshot with every controller report;
the controller holds the latest snapshot per replica, and any ingress replica renders them all
on GET /metrics (serve_app/observability/telemetry.py), so a scrape through the Serve
proxy sees the whole deployment whichever ingress replica answers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.core.histogram import CumulativeHistogram, HistogramSnapshot

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)


@dataclass(frozen=True)
class EngineMetricsSnapshot:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    finished_total: dict[str, int] = field(default_factory=dict)  # by finish reason
    ttft: HistogramSnapshot | None = None
    itl: HistogramSnapshot | None = None
    e2e: HistogramSnapshot | None = None
    queue_time: HistogramSnapshot | None = None
    batch_size: HistogramSnapshot | None = None  # requests per engine step


class EngineMetrics:
    def __init__(self) -> None:
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total: Counter[str] = Counter()
        self.ttft = CumulativeHistogram(LATENCY_BUCKETS)
        self.itl = CumulativeHistogram(ITL_BUCKETS)
        self.e2e = CumulativeHistogram(LATENCY_BUCKETS)
        self.queue_time = CumulativeHistogram(LATENCY_BUCKETS)

    def chunk(self, gap_s: float, num_tokens: int) -> None:
        """A streamed chunk of `num_tokens` after `gap_s`: that many inter-token gaps."""
        if num_tokens > 0:
            self.itl.observe(gap_s / num_tokens, num_tokens)

    def finished(
        self,
        prompt_tokens: int,
        output_tokens: int,
        reason: str | None,
        e2e_s: float,
        queue_time_s: float | None,
    ) -> None:
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += output_tokens
        self.finished_total[reason or "abort"] += 1
        self.e2e.observe(e2e_s)
        if queue_time_s is not None:
            self.queue_time.observe(queue_time_s)

    def snapshot(self, batch_size: HistogramSnapshot | None = None) -> EngineMetricsSnapshot:
        return EngineMetricsSnapshot(
            self.prompt_tokens_total,
            self.generation_tokens_total,
            dict(self.finished_total),
            self.ttft.snapshot(),
            self.itl.snapshot(),
            self.e2e.snapshot(),
            self.queue_time.snapshot(),
            batch_size,
        )
