"""The tuner's answer: which trials meet the target, the cheapest of them, what binds when
none does, and the files a user takes away (report.md, the deploy.yaml fragment, PNGs)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.request_records import Slo
from cluster.tune.search import pareto_front

# Percentile objectives a target may set (figures of every trial).
PERCENTILES = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "e2e_p99_s")


@dataclass(frozen=True)
class Target:
    """`attainment` of requests within every per-request objective of `slo`, and each
    percentile in `percentiles` (e.g. ttft_p99_s) at most its value."""

    slo: Slo
    attainment: float = 0.9
    percentiles: dict[str, float] = field(default_factory=dict)

    def met(self, trial: dict[str, Any]) -> bool:
        return trial["sla_attainment"] >= self.attainment and all(
            trial[k] <= v for k, v in self.percentiles.items()
        )

    def describe(self) -> str:
        parts = [
            f"{name} <= {value:g} s"
            for name, value in (("TTFT", self.slo.ttft_s), ("ITL", self.slo.itl_s))
            + (("E2E", self.slo.e2e_s),)
            if math.isfinite(value)
        ]
        text = f">= {100 * self.attainment:g}% of requests with {' and '.join(parts)}"
        for k, v in self.percentiles.items():
            text += f", {k.removesuffix('_s').replace('_', ' ')} <= {v:g} s"
        return text


def cheapest(trials: list[dict[str, Any]], target: Target) -> dict[str, Any] | None:
    """The fewest replica-hours among the trials that meet the target (None: none does)."""
    ok = [t for t in trials if target.met(t)]
    return min(ok, key=lambda t: (t["replica_hours"], -t["sla_attainment"])) if ok else None


def binding(trials: list[dict[str, Any]], target: Target) -> list[str]:
    """When no trial meets the target: each objective's best over all trials against what
    it needs, the one furthest short first (it binds)."""
    short: list[tuple[float, str]] = []
    objectives = (
        ("ttft", "TTFT", target.slo.ttft_s),
        ("itl", "ITL", target.slo.itl_s),
        ("e2e", "E2E", target.slo.e2e_s),
    )
    for key, name, limit in objectives:
        if not math.isfinite(limit):
            continue
        best = max(t[f"{key}_attainment"] for t in trials)
        line = f"{name} <= {limit:g} s: at best {100 * best:.1f}% of requests in any setting"
        short.append((target.attainment - best, f"{line} (needs {100 * target.attainment:g}%)"))
    best_all = max(t["sla_attainment"] for t in trials)
    short.append(
        (
            target.attainment - best_all,
            f"all per-request objectives together: at best {100 * best_all:.1f}% "
            f"(needs {100 * target.attainment:g}%)",
        )
    )
    for k, v in target.percentiles.items():
        best = min(t[k] for t in trials)
        short.append((best / v - 1, f"{k}: at best {best:.3g} s (needs <= {v:g} s)"))
    return [line for _, line in sorted(short, key=lambda s: -s[0])]


def fragment(trial: dict[str, Any], header: str) -> str:
    """The deploy.yaml `args:` keys of a trial's setting, with a comment saying whence."""
    from cluster.tune.space import Setting

    args = Setting(**trial["setting"]).deploy_args()
    body = yaml.safe_dump(args, sort_keys=False, default_flow_style=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + body


def write(
    out: Path,
    trials: list[dict[str, Any]],
    target: Target,
    title: str,
    complete: bool,
    searched: list[str],
    series: list[tuple[float, int, int, int]] | None,
    arrivals: list[float],
) -> dict[str, Any]:
    """report.md, tuned.yaml (when a trial meets the target), front.png and replicas.png
    (the chosen setting's replicas over time) under `out`; returns the summary. `searched`:
    the knobs that took more than one value (the report names those)."""
    out.mkdir(parents=True, exist_ok=True)
    front = pareto_front(trials)
    chosen = cheapest(trials, target)
    status = "" if complete else " (interrupted: the trials finished so far)"
    lines = [
        f"# Tuning: {title}",
        "",
        f"Target: {target.describe()}. {len(trials)} settings simulated{status}.",
        "",
        "Pareto front (fewer replica-hours, more attainment), cheapest first:",
        "",
        "| replica-hours | attainment | TTFT p99 s | ITL p99 ms | max replicas | setting |",
        "|---|---|---|---|---|---|",
    ]
    for t in front:
        mark = " **chosen**" if t is chosen else ""
        lines.append(
            f"| {t['replica_hours']:.2f} | {100 * t['sla_attainment']:.1f}% "
            f"| {t['ttft_p99_s']:.2f} | {1e3 * t['itl_p99_s']:.0f} | {t['max_replicas']} "
            f"| {_knobs(t['setting'], searched)}{mark} |"
        )
    why: list[str] = []
    if chosen is not None:
        lines += [
            "",
            f"Chosen: {_knobs(chosen['setting'], searched)}; deploy.yaml `args:` in tuned.yaml.",
        ]
        header = f"python -m cluster.tune: {title}\ncheapest of {len(trials)} settings meeting "
        header += f"{target.describe()}:\n{chosen['replica_hours']:.2f} replica-hours, "
        header += f"{100 * chosen['sla_attainment']:.1f}% attainment (simulated)"
        (out / "tuned.yaml").write_text(fragment(chosen, header))
    else:
        why = binding(trials, target)
        lines += ["", "No setting meets the target. Best found per objective:", ""]
        lines += [f"- {w}" for w in why]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _plot(out, trials, front, chosen, target, series, arrivals)
    return {"chosen": chosen, "front": front, "binding": why, "complete": complete}


def _knobs(setting: dict[str, Any], searched: list[str]) -> str:
    return ", ".join(f"{k}={setting[k]}" for k in searched) or "the one setting"


def _plot(out, trials, front, chosen, target, series, arrivals) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(
        [t["replica_hours"] for t in trials],
        [100 * t["sla_attainment"] for t in trials],
        color="0.7",
        s=14,
        label="settings",
    )
    ax.step(
        [t["replica_hours"] for t in front],
        [100 * t["sla_attainment"] for t in front],
        where="post",
        color="C0",
        label="Pareto front",
    )
    ax.axhline(100 * target.attainment, color="C3", linestyle=":", label="target")
    if chosen is not None:
        ax.scatter(
            [chosen["replica_hours"]], [100 * chosen["sla_attainment"]], marker="*", s=200,
            color="C1", label="chosen", zorder=3,
        )  # fmt: skip
    ax.set_xlabel("replica-hours")
    ax.set_ylabel("SLO attainment (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "front.png", dpi=100)
    plt.close(fig)
    if not series:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    end = max(series[-1][0], arrivals[-1] if arrivals else 0.0)
    ax.step(
        [p[0] for p in series] + [end],
        [p[1] + p[2] + p[3] for p in series] + [sum(series[-1][1:])],
        where="post",
        color="C0",
        label="replicas (chosen)",
    )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("replicas")
    bin_s = max(end / 100, 1.0)
    counts = [0] * (int(end // bin_s) + 1)
    for t in arrivals:
        counts[int(t // bin_s)] += 1
    rate_ax = ax.twinx()
    rate_ax.plot([i * bin_s for i in range(len(counts))], [c / bin_s for c in counts], color="0.5")
    rate_ax.set_ylabel("arrivals (req/s)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "replicas.png", dpi=100)
    plt.close(fig)
