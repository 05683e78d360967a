"""Per-request timing records of a simulated run, and their summary against an SLA (pure
Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.metrics import percentile


@dataclass(frozen=True)
class Slo:
    """A request meets its SLA when all hold (an unfinished request meets none)."""

    ttft_s: float = 2.0
    itl_s: float = 0.1
    e2e_s: float = math.inf


@dataclass
class RequestRecord:
    arrival_s: float
    prompt_len: int
    output_len: int
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output: int = 0

    @property
    def ttft(self) -> float:
        return (self.first_token_s or math.inf) - self.arrival_s

    @property
    def itl(self) -> float:
        if self.num_output < 2 or self.first_token_s is None or self.finish_s is None:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.num_output - 1)

    @property
    def e2e(self) -> float:
        return (self.finish_s or math.inf) - self.arrival_s


def summarize_records(
    records: dict[str, RequestRecord], slo: Slo, duration_s: float
) -> dict[str, float]:
    """Throughput, latency percentiles and SLA attainment of a run's requests."""
    recs = list(records.values())
    done = [r for r in recs if r.finish_s is not None]
    met = [r for r in done if r.ttft <= slo.ttft_s and r.itl <= slo.itl_s and r.e2e <= slo.e2e_s]
    n = len(recs)
    out_tokens = sum(r.num_output for r in done)
    dur = max(duration_s, 1e-9)
    return {
        "requests": len(recs),
        "finished": len(done),
        "duration_s": duration_s,
        "output_tok_s": out_tokens / dur,
        "requests_per_s": len(done) / dur,
        "ttft_p50_s": percentile([r.ttft for r in done], 50),
        "ttft_p99_s": percentile([r.ttft for r in done], 99),
        "itl_p50_s": percentile([r.itl for r in done], 50),
        "itl_p99_s": percentile([r.itl for r in done], 99),
        "e2e_p50_s": percentile([r.e2e for r in done], 50),
        "e2e_p99_s": percentile([r.e2e for r in done], 99),
        "sla_attainment": len(met) / n if recs else 1.0,
        # Each objective alone: which one an unmet SLA is short on.
        "ttft_attainment": sum(r.ttft <= slo.ttft_s for r in done) / n if recs else 1.0,
        "itl_attainment": sum(r.itl <= slo.itl_s for r in done) / n if recs else 1.0,
        "e2e_attainment": sum(r.e2e <= slo.e2e_s for r in done) / n if recs else 1.0,
    }
