"""Seeded request traces for the simulator and load tests: arrivals plus prompt/output lengths.

Arrivals: "offline" (everything at t=0), "poisson" (exponential gaps at `rate`), "bursty"
(gamma gaps with the same mean and coefficient of variation `burstiness` > 1), or a diurnal
rate curve with bursts on top (`make_diurnal_workload`, for autoscaling). Traces replayed
from a file: cluster/trace_file.py.

Lengths: fixed, uniform, or lognormal. CHAT_PROMPT / CHAT_OUTPUT are lognormals moment-matched
to the ShareGPT means reported in the vLLM paper (Kwon et al., SOSP 2023: 161 input and 338
output tokens on average); sigma = 1.0 is our assumption (heavy-tailed, as chat traces are),
clipped to [4, 2048] and [4, 1024].
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    adapter: str | None = None  # the LoRA adapter it names (None: the base model)
    model: str | None = None  # the served model it names, where an app serves several
    # The conversation whose tokens its prompt is (cluster/conversations.py): each turn's
    # prompt extends the last one's; None: a prompt of its own.
    conversation: int | None = None
    shared_len: int = 0  # leading prompt tokens every conversation has (a system prompt)


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
    adapters: int = 0,
    adapter_zipf: bool = False,
) -> list[SimRequest]:
    """`num_requests` requests; `rate` is requests/s for poisson and bursty arrivals. With
    `adapters`, each names one of that many LoRA adapters, drawn uniformly or by Zipf's law
    (s = 1)."""
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
        request = SimRequest(f"r{i}", t, prompt.sample(rng), output.sample(rng))
        out.append(request)
    if adapters:  # a draw of their own: the same lengths and arrivals with or without
        draws = random.Random(seed + 1)
        weights = [1.0 / (k + 1) for k in range(adapters)] if adapter_zipf else None
        names = draws.choices([f"adapter-{k}" for k in range(adapters)], weights, k=len(out))
        out = [replace(r, adapter=name) for r, name in zip(out, names, strict=True)]
    return out


@dataclass(frozen=True)
class Burst:
    start_s: float
    duration_s: float
    rate: float  # extra requests/s on top of the diurnal rate


def diurnal_rate(t: float, base: float, peak: float, period_s: float) -> float:
    """A day compressed into period_s: the trough (base) at t = 0, the peak at period_s / 2."""
    return base + (peak - base) * 0.5 * (1.0 - math.cos(2.0 * math.pi * t / period_s))


def make_diurnal_workload(
    duration_s: float,
    base_rate: float,
    peak_rate: float,
    period_s: float,
    bursts: tuple[Burst, ...] = (),
    prompt: LengthDist = CHAT_PROMPT,
    output: LengthDist = CHAT_OUTPUT,
    seed: int = 0,
) -> list[SimRequest]:
    """Poisson arrivals whose rate follows a diurnal curve plus bursts (thinning: candidates
    at the highest rate, each kept with probability rate(t) / highest)."""
    if not 0 < base_rate <= peak_rate or duration_s <= 0 or period_s <= 0:
        raise ValueError("need 0 < base_rate <= peak_rate, duration_s > 0 and period_s > 0")

    def rate(t: float) -> float:
        extra = sum(b.rate for b in bursts if b.start_s <= t < b.start_s + b.duration_s)
        return diurnal_rate(t, base_rate, peak_rate, period_s) + extra

    top = peak_rate + sum(b.rate for b in bursts)
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(top)
        if t >= duration_s:
            return out
        if rng.random() * top <= rate(t):
            out.append(SimRequest(f"r{len(out)}", t, prompt.sample(rng), output.sample(rng)))


# The tuner's named traces (`cluster.tune --workload`): `rate` requests/s (diurnal: at the peak).
LONG_PROMPT = LengthDist("lognormal", 1200, 0.6, lo=64, hi=3000)
SHORT_OUTPUT = LengthDist("lognormal", 150, 0.8, lo=4, hi=512)
NAMED_WORKLOADS = ("chat", "long-prompt", "bursty", "diurnal")


def named_workload(name: str, rate: float, duration_s: float, seed: int = 0) -> list[SimRequest]:
    """chat: Poisson, ShareGPT-like lengths. long-prompt: Poisson, RAG-like prompts (1,200
    tokens on average) and short answers. bursty: chat lengths, gamma gaps with a coefficient
    of variation of 3. diurnal: chat lengths, a day compressed into `duration_s` (trough at
    15% of the peak) with a burst of +80% for a thirtieth of it, a third of the way in."""
    n = max(1, round(rate * duration_s))
    if name == "chat":
        return make_workload(n, rate, "poisson", seed=seed)
    if name == "long-prompt":
        return make_workload(n, rate, "poisson", LONG_PROMPT, SHORT_OUTPUT, seed=seed)
    if name == "bursty":
        return make_workload(n, rate, "bursty", seed=seed)
    if name == "diurnal":
        burst = Burst(duration_s / 3, duration_s / 30, 0.8 * rate)
        return make_diurnal_workload(duration_s, 0.15 * rate, rate, duration_s, (burst,), seed=seed)
    raise ValueError(f"workload: one of {', '.join(NAMED_WORKLOADS)}, got {name!r}")
