"""A sweep's summaries and outputs: per-level figures, the knee, sweep.json, sweep.csv,
report.md and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from cluster.metrics import percentile
from loadtests.plotting import pyplot
from loadtests.sweep.level import LevelResult

KNEE_SHARE = 0.9


def summarize(level: LevelResult, slo_ttft_s: float, slo_itl_s: float) -> dict[str, Any]:
    reqs = level.requests
    ok = [r for r in reqs if r.status == "ok"]
    wall = max(level.wall_s, 1e-9)
    good = [
        r
        for r in ok
        if r.ttft_s is not None
        and r.ttft_s <= slo_ttft_s
        and (r.mean_itl_s is None or r.mean_itl_s <= slo_itl_s)
    ]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    e2e = [r.e2e_s for r in ok]
    row: dict[str, Any] = {
        "mode": level.mode,
        "level": level.value,
        "wall_s": level.wall_s,
        "requests": len(reqs),
        "ok": len(ok),
        "errors": sum(1 for r in reqs if r.status not in ("ok", "429")),
        "rejected_429": sum(1 for r in reqs if r.status == "429"),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "tokens_received": sum(r.tokens_received for r in ok),
        "output_tok_s": sum(r.output_tokens for r in ok) / wall,
        "requests_per_s": len(ok) / wall,
        "goodput_requests_per_s": len(good) / wall,
        "goodput_tok_s": sum(r.output_tokens for r in good) / wall,
    }
    for name, values in (("ttft", ttft), ("itl", gaps), ("e2e", e2e)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = 1e3 * percentile(values, q) if values else None
    return row


def knee_index(rows: list[dict[str, Any]]) -> int | None:
    """The first level whose throughput reaches KNEE_SHARE of the best level's."""
    if not rows:
        return None
    best = max(r["output_tok_s"] for r in rows)
    return next(i for i, r in enumerate(rows) if r["output_tok_s"] >= KNEE_SHARE * best)


# ---------------------------------------------------------------------------- outputs
def write_outputs(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2))
    rows = [row | {"variant": name} for name, v in result["variants"].items() for row in v["rows"]]
    if rows:
        with (out / "sweep.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    lines = [
        "# Latency-throughput sweep",
        "",
        f"Target {result['url']}, workload `{result['workload']['kind']}`, SLO: TTFT <= "
        f"{result['slo_ttft_ms']:.0f} ms, mean ITL <= {result['slo_itl_ms']:.0f} ms. "
        "Knee: the first level at >= 90% of the best throughput (marked *).",
        "",
    ]
    for name, v in result["variants"].items():
        lines += [
            f"## {name}",
            "",
            "| level | req | ok | 429 | err | out tok/s | req/s | goodput req/s | TTFT p50/p99 ms "
            "| ITL p50/p99 ms | E2E p50/p99 ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for i, r in enumerate(v["rows"]):
            mark = "*" if i == v["knee"] else ""
            lines.append(
                f"| {r['mode']} {r['level']:g}{mark} | {r['requests']} | {r['ok']} "
                f"| {r['rejected_429']} | {r['errors']} | {r['output_tok_s']:.1f} "
                f"| {r['requests_per_s']:.2f} | {r['goodput_requests_per_s']:.2f} "
                f"| {_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])} "
                f"| {_ms(r['itl_p50_ms'])} / {_ms(r['itl_p99_ms'])} "
                f"| {_ms(r['e2e_p50_ms'])} / {_ms(r['e2e_p99_ms'])} |"
            )
        lines.append("")
    if len(result["variants"]) > 1:
        lines += _ab_table(result)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _plots(result, out)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _ab_table(result: dict[str, Any]) -> list[str]:
    names = list(result["variants"])
    base = names[0]
    lines = [f"## A/B against `{base}` (output tok/s ratio per level)", ""]
    lines += ["| level | " + " | ".join(names[1:]) + " |", "|---" * len(names) + "|"]
    base_rows = result["variants"][base]["rows"]
    for i, row in enumerate(base_rows):
        cells = []
        for name in names[1:]:
            other = result["variants"][name]["rows"]
            ratio = other[i]["output_tok_s"] / row["output_tok_s"] if row["output_tok_s"] else 0
            cells.append(f"{ratio:.2f}x" if i < len(other) else "-")
        lines.append(f"| {row['mode']} {row['level']:g} | " + " | ".join(cells) + " |")
    return lines + [""]


def _plots(result: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, v) in enumerate(result["variants"].items()):
        xs = [r["level"] for r in v["rows"]]
        ax.plot(xs, [r["output_tok_s"] for r in v["rows"]], "o-", color=f"C{i}", label=name)
        if v["knee"] is not None:
            k = v["rows"][v["knee"]]
            ax.plot([k["level"]], [k["output_tok_s"]], "*", color=f"C{i}", markersize=14)
    mode = result["mode"]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency" if mode == "concurrency" else "offered rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for metric, ax in zip(("ttft", "e2e"), axes, strict=True):
        for i, (name, v) in enumerate(result["variants"].items()):
            xs = [r["output_tok_s"] for r in v["rows"]]
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ys = [r[f"{metric}_{q}_ms"] or 0 for r in v["rows"]]
                ax.plot(xs, ys, style, color=f"C{i}", label=f"{name} {q}")
            if v["knee"] is not None:
                ax.axvline(v["rows"][v["knee"]]["output_tok_s"], color=f"C{i}", linestyle=":")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_throughput.png", dpi=100)
    plt.close(fig)


# -------------------------------------------------------------------------------- run
