"""The reports of `python -m loadtests.bench_sim`: report.md tables and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtests.plotting import pyplot


def write_report(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Static vs dynamic batching (simulator)",
        "",
        "| setting | policy | static max_num_seqs | output tok/s | capacity req/s | TTFT p99 s "
        "| ITL p50 ms | preemptions | mean batch | mean KV use |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        cap = f"{r['capacity_rps']:.2f}" if r["capacity_rps"] is not None else ""
        lines.append(
            f"| {r['setting']} | {r['policy']} | {r['static_max_num_seqs'] or ''} "
            f"| {r['output_tok_s']:.0f} | {cap} | {r['ttft_p99_s']:.2f} "
            f"| {1e3 * r['itl_p50_s']:.1f} | {r['preemptions']} | {r['mean_batch_size']:.1f} "
            f"| {r['mean_kv_usage']:.2f} |"
        )
    lines += [
        "",
        "| setting | best static (throughput) | throughput gain | best static (capacity) "
        "| capacity gain |",
        "|---|---|---|---|---|",
    ]
    for name, g in result["per_setting"].items():
        lines.append(
            f"| {name} | {g['best_static_max_num_seqs']} | {100 * g['throughput_gain']:+.1f}% "
            f"| {g['best_static_capacity_max_num_seqs']} | {100 * g['capacity_gain']:+.1f}% |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    for cpu_json in sorted(out.glob("cpu-*.json")):  # the real-engine comparison, if run
        write_cpu_section(json.loads(cpu_json.read_text()), out)
    plt = pyplot()
    if plt is None:
        return
    for name in result["per_setting"]:
        rows = [r for r in result["rows"] if r["setting"] == name]
        static = [r for r in rows if r["policy"] == "static"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(
            [r["static_max_num_seqs"] for r in static],
            [r["output_tok_s"] for r in static],
            "o-",
            label="static",
        )
        for r in rows:
            if r["policy"] != "static":
                ax.axhline(
                    r["output_tok_s"],
                    linestyle="--",
                    label=r["policy"],
                    color={"memory_aware": "C1", "sla": "C2", "combined": "C3"}[r["policy"]],
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("static max_num_seqs")
        ax.set_ylabel("output tokens/s")
        ax.set_title(name)
        ax.legend()
        fig.tight_layout()
        slug = name.split(",")[0].replace(" ", "_")
        fig.savefig(out / f"throughput_{slug}.png", dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        caps = [
            (
                r["policy"] if r["policy"] != "static" else f"static {r['static_max_num_seqs']}",
                r["capacity_rps"],
            )
            for r in rows
            if r["capacity_rps"] is not None
        ]
        ax.bar([c[0] for c in caps], [c[1] for c in caps])
        ax.set_ylabel("capacity (req/s, >= 90% within SLO)")
        ax.set_title(name)
        fig.tight_layout()
        fig.savefig(out / f"capacity_{slug}.png", dpi=100)
        plt.close(fig)


CPU_HEADING = "## The same comparison on the real CPU engine"


def write_cpu_section(result: dict[str, Any], out: Path) -> None:
    """Save `bench_sim cpu`'s result as out/cpu-<model>.json and put its table in
    out/report.md (replacing an earlier one), below the simulator's tables."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cpu-{result['model']}.json").write_text(json.dumps(result, indent=2) + "\n")
    report = out / "report.md"
    head = report.read_text().split(CPU_HEADING)[0].rstrip() if report.exists() else ""
    lines = [
        CPU_HEADING,
        "",
        f"Model `{result['model']}`, the first {result['num_requests']} mixed-200 requests "
        f"(offline, ignore_eos), a {result['kv_mb']} MB KV cache, this machine's 2 cores.",
        "",
        "| policy | static max_num_seqs | output tok/s | preemptions | mean batch |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['static_max_num_seqs'] or ''} | {r['output_tok_s']:.1f} "
            f"| {r['preemptions']} | {r['mean_batch_size']:.1f} |"
        )
    lines += [
        "",
        f"Best dynamic over best static: {100 * result['best_throughput_gain']:+.1f}%.",
    ]
    report.write_text((head + "\n\n" if head else "") + "\n".join(lines) + "\n")
