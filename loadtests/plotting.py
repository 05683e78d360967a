"""matplotlib for the benchmarks' PNGs, headless; None (and a note) when it is not installed."""

from __future__ import annotations

import sys


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG plots", file=sys.stderr)
        return None
    return plt
