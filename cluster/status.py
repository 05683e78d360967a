"""`python -m cluster.status [--url http://127.0.0.1:8000] [--json]`: the controller's view
(GET /v1/cluster) as a table: one row per engine replica, its load, limits and decision."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

COLUMNS = (
    ("replica", 10),
    ("run", 4),
    ("wait", 5),
    ("kv", 6),
    ("kv blocks", 11),
    ("preempt", 7),
    ("spec acc", 8),
    ("decode ms", 9),
    ("batch", 6),
    ("ttft p50", 8),
    ("itl p50", 8),
    ("max_seqs", 8),
    ("weight", 6),
    ("age s", 6),
)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def rows(view: dict[str, Any]) -> list[tuple[str, ...]]:
    out = []
    for r in view["replicas"]:
        decode = r["decode"] or {}
        out.append(
            (
                r["replica_id"][:10],
                str(r["running"]),
                str(r["waiting"]),
                f"{r['kv_usage']:.0%}",
                f"{r['kv_blocks_used']}/{r['kv_blocks_total']}",
                str(r["preemptions_total"]),
                "-" if r.get("spec_acceptance") is None else f"{r['spec_acceptance']:.0%}",
                _ms(decode.get("mean_step_s")),
                f"{decode['mean_batch']:.1f}" if decode else "-",
                _ms(r["ttft"]["p50_s"]),
                _ms(r["itl"]["p50_s"]),
                str(r["limits"]["max_num_seqs"]) + ("*" if r["throttled"] else ""),
                f"{r['routing_weight']:.2f}",
                f"{r['age_s']:.1f}",
            )
        )
    return out


def render(view: dict[str, Any]) -> str:
    lines = [
        f"{view['num_replicas']} engine replicas reporting; {view['reports_total']} reports, "
        f"{view['expired_total']} replicas expired; "
        f"controller up {view.get('controller_uptime_s', 0):.0f} s",
        "  ".join(name.rjust(width) for name, width in COLUMNS),
    ]
    for row in rows(view):
        lines.append(
            "  ".join(cell.rjust(width) for cell, (_, width) in zip(row, COLUMNS, strict=True))
        )
    notes = [f"{r['replica_id'][:10]}: {r['reason']}" for r in view["replicas"] if r["reason"]]
    if notes:
        lines.append("* throttled by the cluster SLA rule:")
        lines.extend("  " + n for n in notes)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the app's base URL")
    parser.add_argument("--json", action="store_true", help="print the raw JSON view")
    args = parser.parse_args(argv)
    try:
        with urllib.request.urlopen(f"{args.url.rstrip('/')}/v1/cluster", timeout=10) as resp:
            view = json.load(resp)
    except urllib.error.HTTPError as exc:
        print(f"{exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(view, indent=2) if args.json else render(view))
    return 0


if __name__ == "__main__":
    sys.exit(main())
