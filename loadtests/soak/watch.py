"""What the soak watches besides its requests: the resident memory of every process of the
Ray cluster it started (sampled over time), and the stacks of all of them when a request
outlives its deadline (py-spy, which ray[default] installs)."""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# A process's RSS is judged from this long after it first appears (imports, model load, the
# first batches' allocator pools).
PROCESS_WARMUP_S = 60.0
# Samples averaged at each end of a process's judged span (RSS moves with each batch).
_END_SAMPLES = 3
# At most this many stack captures per run, at least this far apart.
MAX_CAPTURES = 5
CAPTURE_GAP_S = 30.0
# What a Ray worker process is called before it hosts an actor.
_UNSETTLED = {"IDLE", "default_worker", "gone"}


def role_of(proc: psutil.Process) -> str:
    """What a process of the cluster is: the Serve deployment of a replica ("EngineServer"),
    a Ray actor's class, or the executable (raylet, gcs_server, ...)."""
    try:
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    head = cmdline[0] if cmdline else proc.name()
    if head.startswith("ray::"):
        title = head.removeprefix("ray::").split()[0].split(".")[0]  # less a running method
        # ServeReplica:APP:DEPLOYMENT, or at start SERVE_REPLICA::APP#...:ServeReplica:APP:...
        return title.rsplit(":", 1)[-1] if "ServeReplica:" in title else title
    name = Path(head).name
    if not name.startswith("python"):
        return name
    args = iter(cmdline[1:])
    for arg in args:
        if arg == "-m":  # python -m module (the soak itself)
            return next(args, name)
        if not arg.startswith("-"):  # python [-u] script.py (Ray's dashboard, log monitor)
            return Path(arg).stem
    return name


def cluster_processes() -> list[psutil.Process]:
    """This process and every process it started: with a Ray cluster started by this
    process, its GCS, raylet and workers (another Ray cluster on the machine is not ours)."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


@dataclass
class MemorySeries:
    """Every process's RSS over time: pid -> [(seconds since start, bytes)], and its role."""

    start: float = field(default_factory=time.monotonic)
    samples: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)

    def sample(self) -> None:
        now = time.monotonic() - self.start
        for proc in cluster_processes():
            try:
                rss = proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            role = role_of(proc)
            # A worker is IDLE (or a bare default_worker) until it becomes an actor.
            if role not in _UNSETTLED or proc.pid not in self.roles:
                self.roles[proc.pid] = role
            self.samples.setdefault(proc.pid, []).append((now, rss))

    def by_role(self) -> dict[str, list[tuple[float, float]]]:
        """The summed RSS (MB) of each role's processes at each sampling time (for a plot)."""
        totals: dict[str, dict[float, float]] = {}
        for pid, series in self.samples.items():
            role_totals = totals.setdefault(self.roles[pid], {})
            for t, rss in series:
                role_totals[t] = role_totals.get(t, 0.0) + rss / 2**20
        return {role: sorted(points.items()) for role, points in sorted(totals.items())}

    def growth(self, warmup_s: float) -> list[dict]:
        """Per process that lived long enough to judge: its RSS (MB) once warm (from
        max(warmup_s, its first sample + PROCESS_WARMUP_S)) and at its last samples, and the
        growth between; the largest growth first."""
        rows = []
        for pid, series in self.samples.items():
            warm_from = max(warmup_s, series[0][0] + PROCESS_WARMUP_S)
            judged = [rss for t, rss in series if t >= warm_from]
            if len(judged) < 2 * _END_SAMPLES:
                continue
            first = statistics.median(judged[:_END_SAMPLES]) / 2**20
            last = statistics.median(judged[-_END_SAMPLES:]) / 2**20
            span = series[-1][0] - warm_from
            rows.append(
                {
                    "pid": pid,
                    "role": self.roles[pid],
                    "warm_mb": round(first, 1),
                    "last_mb": round(last, 1),
                    "growth_mb": round(last - first, 1),
                    "judged_s": round(span),
                }
            )
        return sorted(rows, key=lambda r: -r["growth_mb"])


@dataclass
class StackCapture:
    """py-spy stacks of every Python process of the cluster, saved under `directory`, at most
    MAX_CAPTURES times a run and CAPTURE_GAP_S apart."""

    directory: Path
    captures: list[str] = field(default_factory=list)
    _last: float = -CAPTURE_GAP_S

    def due(self) -> bool:
        now = time.monotonic()
        return len(self.captures) < MAX_CAPTURES and now - self._last >= CAPTURE_GAP_S

    def capture(self, reason: str) -> str | None:
        """Dump every process's stacks (blocking: run it in a thread); returns the folder."""
        if not self.due():
            return None
        self._last = time.monotonic()
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        folder = self.directory / f"capture-{len(self.captures)}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "REASON.txt").write_text(reason + "\n")
        for proc in cluster_processes():
            role = re.sub(r"[^A-Za-z0-9_.-]", "_", role_of(proc))
            if proc.pid == os.getpid():
                continue  # py-spy cannot stop the process that waits for it
            try:
                dump = subprocess.run(
                    [py_spy, "dump", "--pid", str(proc.pid)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                text = dump.stdout or dump.stderr
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"py-spy failed: {exc!r}"
            if "Error: Failed to find python version" in text:
                continue  # not a Python process (raylet, gcs_server)
            (folder / f"{role}-{proc.pid}.txt").write_text(text)
        self.captures.append(str(folder))
        return str(folder)
