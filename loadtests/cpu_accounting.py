"""CPU seconds per process over a stretch of a benchmark, from /proc (Linux only).

On a 2-core machine the serving path's overhead is CPU the engine does not get, so CPU-ms per
output token of each Serve process is the steady figure behind a noisy tokens/s ratio.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_times() -> dict[str, float]:
    """Machine-wide CPU seconds by state since boot (all cores), from the first line of
    /proc/stat."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    with open("/proc/stat") as f:
        values = f.readline().split()[1 : 1 + len(names)]
    return {n: int(v) / _TICKS for n, v in zip(names, values, strict=True)}


def host_info() -> dict[str, object]:
    """What the figures were measured on. The VMs behind this project's machines change
    between sessions (an AVX-512 host reached 325 GFLOP/s in a float32 GEMM, an AVX2 Zen 3
    host 185), so a figure means little without the host it came from."""
    info: dict[str, object] = {"cpus": os.cpu_count() or 0, "cpu": "unknown", "simd": "unknown"}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return info
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE)
    if model:
        info["cpu"] = model.group(1).strip()
    if flags:
        have = set(flags.group(1).split())
        info["simd"] = next(
            (name for name in ("avx512f", "avx2", "avx", "sse4_2") if name in have), "none"
        )
    return info


def steal_fraction(before: dict[str, float], after: dict[str, float]) -> float:
    """Share of the machine's CPU time the hypervisor gave to other guests between two
    `machine_times()` snapshots. On a shared VM this swings from 0 to over 30% within minutes
    and is the main reason one benchmark run differs from the next."""
    total = sum(after[k] - before[k] for k in after)
    return (after["steal"] - before["steal"]) / total if total > 0 else 0.0


def steal_adjusted(rate: float, steal_frac: float) -> float:
    """A rate per wall second turned into a rate per CPU second the guest actually got."""
    return rate / max(1e-9, 1.0 - steal_frac)


class StealMeter:
    """`with StealMeter() as m: ...` then `m.fraction`: the steal share over the block."""

    fraction: float = 0.0

    def __enter__(self) -> StealMeter:
        self._before = machine_times()
        return self

    def __exit__(self, *exc: object) -> None:
        self.fraction = steal_fraction(self._before, machine_times())


def _name(pid: str) -> str:
    """Ray's process title ("ray::ServeReplica:app:EngineServer"), else the program name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace")
    if first.startswith("ray::"):
        return re.sub(r"ServeReplica:[^:]*:", "", first.split()[0])
    return os.path.basename(first) or "?"


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the program's name (the state first, the parent's pid
    second, utime and stime at 11 and 12), or None for a process gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds so far, from stat_fields."""
    return (int(fields[11]) + int(fields[12])) / _TICKS


def snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (name, user + system CPU seconds so far)."""
    out: dict[int, tuple[str, float]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = stat_fields(pid)
        if fields is not None:
            out[int(pid)] = (_name(pid), cpu_seconds(fields))
    return out


def cpu_by_process(before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each process name used since `before`, largest first (processes that
    started since count from zero; ones that ended are lost)."""
    used: dict[str, float] = defaultdict(float)
    for pid, (name, cpu) in snapshot().items():
        used[name] += cpu - (before[pid][1] if pid in before else 0.0)
    return dict(sorted(((n, s) for n, s in used.items() if s > 0.005), key=lambda x: -x[1]))
