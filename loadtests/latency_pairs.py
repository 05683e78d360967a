"""What serving adds to one request's latency, prompt by prompt: each prompt sent in process
and over HTTP back to back, one client, which side goes first alternating.

A one-client figure on a small shared host moves by tens of milliseconds between minutes
(another tenant, the app's own background), and rounds of one side then the other take that
drift into their difference of medians. Within a pair both requests meet nearly the same
host, so the median of the pairs' differences reads what serving adds to the same prompt,
which is how issue 55 defines it; its 95% interval says how far the pairs' scatter leaves it
unsure.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from loadtests.closed_loop import RequestTiming, http_request, inprocess_request
from loadtests.workload import WorkItem


@dataclass
class LatencyPairs:
    pairs: list[tuple[RequestTiming, RequestTiming]] = field(default_factory=list)  # (in, HTTP)

    def summary(self) -> dict[str, float | int | list[float]]:
        ttft = [1e3 * (http.ttft - inproc.ttft) for inproc, http in self.pairs]
        itl = [
            1e3 * (b - a)
            for inproc, http in self.pairs
            if (a := inproc.itl) is not None and (b := http.itl) is not None
        ]
        return {
            "pairs": len(self.pairs),
            "ttft_added_ms": statistics.median(ttft),
            "ttft_added_ci95_ms": median_interval(ttft),
            "itl_added_ms": statistics.median(itl) if itl else math.nan,
            "itl_added_ci95_ms": median_interval(itl) if itl else [math.nan, math.nan],
            "inprocess_ttft_p50_ms": 1e3 * statistics.median(p[0].ttft for p in self.pairs),
            "http_ttft_p50_ms": 1e3 * statistics.median(p[1].ttft for p in self.pairs),
            # Each pair's TTFTs in the order sent (in process first in the even ones).
            "ttft_ms": [[round(1e3 * a.ttft, 2), round(1e3 * b.ttft, 2)] for a, b in self.pairs],
        }


def median_interval(values: list[float]) -> list[float]:
    """A distribution-free 95% interval for the median: the order statistics a sign test
    puts around it (the whole range where there are too few values for one)."""
    ordered = sorted(values)
    n = len(ordered)
    k = math.floor((n - 1.96 * math.sqrt(n)) / 2)  # values below the interval
    if k < 1:
        return [ordered[0], ordered[-1]]
    return [ordered[k - 1], ordered[n - k]]


async def run_pairs(engine, client, model: str, items: list[WorkItem], passes: int) -> LatencyPairs:
    """`passes` times over `items`: each in process (`engine`, an AsyncLLMEngine) and over
    HTTP (`client`, an SseClient), the first item of each pass once more before it as a
    warm-up kept out."""
    result = LatencyPairs()
    for p in range(passes):
        warm = replace(items[0], request_id=f"{items[0].request_id}#warm{p}")
        await inprocess_request(engine, warm)
        await http_request(client, model, warm)
        for i, it in enumerate(items):
            it = replace(it, request_id=f"{it.request_id}#pair{p}")
            if (p * len(items) + i) % 2 == 0:
                inproc = await inprocess_request(engine, it)
                http = await http_request(client, model, it)
            else:
                http = await http_request(client, model, it)
                inproc = await inprocess_request(engine, it)
            result.pairs.append((inproc, http))
    return result
