"""Which of the cluster's processes cost the one-client TTFT: over one app (local_app.py's,
or `make serve`'s), blocks of five streamed chats (one_client.py's shape, one kept-alive
connection) with nothing stopped (`all`), with one group of the cluster's processes
SIGSTOPped, or with every process but the ingress and engine replicas stopped (`bare`); the
arms rotate every round. Prints each arm's median TTFT and TPOT, ms.

  .venv/bin/python reports/serving/cpu-host-2026-12-07-s64/who_costs_ttft.py URL/v1 6
"""

import contextlib
import os
import signal
import statistics
import sys
import time

import psutil
from one_client import OneClient  # beside this script

url, rounds = sys.argv[1], int(sys.argv[2])
chat = OneClient(url).chat
KEPT = ("EngineServer", "OpenAIIngress")
SYSTEM = ("raylet", "gcs_server", "dashboard", "log_monitor", "Agent", "local_app", "launch")
GROUPS = {
    "raylet": ("/raylet",),
    "gcs": ("gcs_server",),
    "dashboard": ("dashboard.py",),
    "agents": ("Agent",),
    "log_monitor": ("log_monitor",),
    "driver": ("local_app", "deploy.launch"),
    "ray_system": SYSTEM,
    "serve_controller": ("ServeController",),
    "our_controllers": ("ClusterController", "AppTables"),
    "proxy": ("ProxyActor",),
}


def cluster() -> list[tuple[psutil.Process, str]]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        command = " ".join(p.info["cmdline"] or [])
        if p.pid != os.getpid() and ("ray" in command or "local_app" in command):
            found.append((p, command))
    return found


def signal_all(processes: list[tuple[psutil.Process, str]], sig: int) -> None:
    for p, _ in processes:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


processes = cluster()
for _ in range(3):
    chat()
arms = ["all", *GROUPS, "bare"]
results: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
try:
    for r in range(rounds):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            signal_all(processes, signal.SIGCONT)
            if arm == "bare":
                stopped = [x for x in processes if not any(k in x[1] for k in KEPT)]
            elif arm != "all":
                stopped = [x for x in processes if any(k in x[1] for k in GROUPS[arm])]
            else:
                stopped = []
            signal_all(stopped, signal.SIGSTOP)
            time.sleep(0.7)
            results[arm] += [chat() for _ in range(5)]
finally:
    signal_all(processes, signal.SIGCONT)
for arm, got in results.items():
    ttft, tpot = (statistics.median(x[i] for x in got) for i in (0, 1))
    print(f"{arm}: TTFT {ttft:.1f} TPOT {tpot:.2f}")
