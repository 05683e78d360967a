"""loadtests.idle_cpu counts the CPU of every process below the one it launched, by name,
and nothing outside that tree."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from loadtests.idle_cpu import idle_usage

# A parent that sleeps and a child (its own program name) that spins for the whole window.
_TREE = textwrap.dedent(
    """
    import subprocess, sys, time
    spin = "import time\\nend = time.monotonic() + 3\\nwhile time.monotonic() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin, "spinner.py"])
    child.wait()
    """
)


def test_the_processes_below_the_launch_are_counted_by_name():
    outside = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    tree = subprocess.Popen([sys.executable, "-c", _TREE])
    try:
        usage = idle_usage(tree.pid, seconds=1.5)
    finally:
        outside.kill()
        tree.wait()
    spinning = [u["cpu_ms_per_s"] for name, u in usage.items() if name.startswith("python")]
    # The spinning child takes about a core (two python processes in the tree: it and its
    # sleeping parent); the spinner outside the tree is not counted.
    assert 300 < sum(spinning) < 1300, usage
    assert all(u["rss_mb"] > 0 for u in usage.values()), usage
