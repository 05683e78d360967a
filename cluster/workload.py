"""Seeded request traces for the simulator and load tests: arrivals plus prompt/output lengths.

Arrivals: "offline" (everything at t=0), "poisson" (exponential gaps at `rate`), "bursty"
(gamma gaps with the same mean and coefficient of variation `burstiness` > 1), or replayed from
a JSONL trace (one object per line: `arrival_s`, `prompt_len`, `output_len`).

Lengths: fixed, uniform, or lognormal. CHAT_PROMPT / CHAT_OUTPUT are lognormals moment-matched
to the ShareGPT means reported in the vLLM paper (Kwon et al., SOSP 2023: 161 input and 338
output tokens on average); sigma = 1.0 is our assumption (heavy-tailed, as chat traces are),
clipped to [4, 2048] and [4, 1024].
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class LengthDist:
    kind: Literal["fixed", "uniform", "lognormal"]
    a: float  # fixed: the length; uniform: low; lognormal: mean
    b: float = 0.0  # uniform: high; lognormal: sigma
    lo: int = 1
    hi: int = 1 << 20

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            n = self.a
        elif self.kind == "uniform":
            n = rng.randint(int(self.a), int(self.b))
        else:  # moment-matched: E[X] = exp(mu + sigma^2 / 2) = a
            mu = math.log(self.a) - self.b**2 / 2
            n = rng.lognormvariate(mu, self.b)
        return int(min(max(round(n), self.lo), self.hi))


CHAT_PROMPT = LengthDist("lognormal", 161, 1.0, lo=4, hi=2048)
CHAT_OUTPUT = LengthDist("lognormal", 338, 1.0, lo=4, hi=1024)

Arrival = Literal["offline", "poisson", "bursty"]


def make_workload(
    num_requests: int,
    rate: float = 1.0,
    arrival: Arrival = "poisson",
    prompt: LengthDist = CHAT_PROMPT,
    output: LengthDist = CHAT_OUTPUT,
    seed: int = 0,
    burstiness: float = 3.0,
) -> list[SimRequest]:
    """`num_requests` requests; `rate` is requests/s for poisson and bursty arrivals."""
    if num_requests < 0 or (arrival != "offline" and rate <= 0):
        raise ValueError("need num_requests >= 0 and rate > 0")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(num_requests):
        if arrival == "poisson":
            t += rng.expovariate(rate)
        elif arrival == "bursty":  # gamma with mean 1/rate and CV = burstiness
            shape = 1.0 / burstiness**2
            t += rng.gammavariate(shape, 1.0 / (rate * shape))
        out.append(SimRequest(f"r{i}", t, prompt.sample(rng), output.sample(rng)))
    return out


def load_trace(path: str | Path) -> list[SimRequest]:
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        out.append(
            SimRequest(
                str(row.get("request_id", f"r{i}")),
                float(row["arrival_s"]),
                int(row["prompt_len"]),
                int(row["output_len"]),
            )
        )
    return sorted(out, key=lambda r: r.arrival_s)


def save_trace(requests: list[SimRequest], path: str | Path) -> None:
    lines = [json.dumps(r.__dict__) for r in requests]
    Path(path).write_text("\n".join(lines) + "\n")
