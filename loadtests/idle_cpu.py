"""What an idle app costs the host, process by process: deploy.yaml served as `make serve`
serves it (`serve run` on a local Ray cluster; `--dashboard`: with Ray's), nothing sent to it.

    python -m loadtests.idle_cpu [--config deploy.yaml] [--model small] [--seconds 20]
                                 [--env RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5] [--dashboard]
                                 [--json]

On a CPU host each millisecond the cluster's processes run beside an engine step is taken
from the step's threads (on two cores a prefill runs about a tenth slower beside the idle app
than with its processes stopped), so this is the figure to cut. Prints the ms of CPU a second
and the resident MB of every process the launch started (Ray's process titles), and the
totals. Two configurations compare by running this once for each, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from loadtests.cpu_accounting import cpu_seconds, host_info, stat_fields
from loadtests.workload import REPO, resolve_model

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _descendants(root: int) -> set[int]:
    """`root` and every process below it, from /proc's parent links."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = stat_fields(pid)
        if fields is not None:
            children[int(fields[1])].append(int(pid))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


def _name(pid: int) -> str:
    """Ray's title ("ray::ServeReplica:llm:EngineServer" -> "EngineServer"), a dashboard
    module's, or the program's name."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    first = argv[0] if argv else "?"
    if first.startswith("ray::"):  # the actor's class, without the method it runs
        return first.split()[0].removeprefix("ray::").split(":")[-1].split(".")[0]
    if first.startswith("ray-dashboard-"):
        return "dashboard module"
    script = next((Path(a).name for a in argv[1:3] if a.endswith(".py")), "")
    return f"{Path(first).name} {script}".strip()


def _usage(pids: set[int]) -> dict[int, tuple[str, float, float]]:
    """pid -> (name, user + system CPU seconds so far, resident MB)."""
    out = {}
    for pid in pids:
        fields = stat_fields(pid)
        if fields is None:  # gone
            continue
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * _PAGE / 2**20
            name = _name(pid)
        except (OSError, IndexError):  # gone since
            continue
        out[pid] = (name, cpu_seconds(fields), rss)
    return out


def idle_usage(root: int, seconds: float) -> dict[str, dict[str, float]]:
    """Per process name below `root`: `cpu_ms_per_s` over `seconds` and `rss_mb` (summed over
    the processes of that name), largest CPU first."""
    before = _usage(_descendants(root))
    start = time.monotonic()
    time.sleep(seconds)
    after = _usage(_descendants(root))
    elapsed = time.monotonic() - start
    by_name: dict[str, dict[str, float]] = defaultdict(lambda: {"cpu_ms_per_s": 0.0, "rss_mb": 0})
    for pid, (name, cpu, rss) in after.items():
        used = cpu - before[pid][1] if pid in before else cpu
        by_name[name]["cpu_ms_per_s"] += 1000 * used / elapsed
        by_name[name]["rss_mb"] += rss
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]["cpu_ms_per_s"]))


def _config(path: str, model: str) -> tuple[str, int]:
    """The config with its (first) app serving `model`, in a temporary file; and the proxy's
    port."""
    config = yaml.safe_load(Path(path).read_text())
    args = config["applications"][0]["args"]
    args["model"] = resolve_model(model)
    args["served_model_name"] = Path(args["model"]).name
    fd, out = tempfile.mkstemp(suffix=".yaml")
    os.close(fd)
    Path(out).write_text(yaml.safe_dump(config))
    return out, int(config.get("http_options", {}).get("port", 8000))


def _wait_ready(port: int, launch: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launch.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise SystemExit(f"the app did not answer on port {port} within {timeout:g} s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "deploy.yaml"))
    parser.add_argument("--model", default="small", help="tiny, small or a checkpoint dir")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to measure")
    parser.add_argument("--settle", type=float, default=15.0, help="wait after ready")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the cluster")
    parser.add_argument("--dashboard", action="store_true", help="launch with Ray's dashboard")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args(argv)
    path, port = _config(opts.config, opts.model)
    env = dict(os.environ) | dict(kv.split("=", 1) for kv in opts.env)
    launch = subprocess.Popen(
        [sys.executable, "-m", "serve_app.deploy.launch", path] + ["--dashboard"] * opts.dashboard,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_ready(port, launch, 300.0)
        time.sleep(opts.settle)
        usage = idle_usage(launch.pid, opts.seconds)
    finally:
        launch.send_signal(signal.SIGTERM)  # `serve run` ends its local cluster
        try:
            launch.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
        os.unlink(path)
    result = {
        "host": host_info(),
        "env": opts.env,
        "dashboard": opts.dashboard,
        "seconds": opts.seconds,
        "total_cpu_ms_per_s": sum(u["cpu_ms_per_s"] for u in usage.values()),
        "total_rss_mb": sum(u["rss_mb"] for u in usage.values()),
        "processes": usage,
    }
    if opts.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"idle app, {opts.seconds:g} s: {result['total_cpu_ms_per_s']:.1f} ms of CPU a "
            f"second, {result['total_rss_mb']:.0f} MB resident"
        )
        for name, u in usage.items():
            print(f"  {u['cpu_ms_per_s']:7.1f} ms/s  {u['rss_mb']:6.0f} MB  {name}")
    return result


if __name__ == "__main__":
    main()
