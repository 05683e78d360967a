"""Ours (deploy.yaml with `small`, as `make serve` launches it) and vLLM-CPU's own server,
both up at once; the client alternates blocks between them while the other server's whole
process tree is SIGSTOPped (no CPU of its own taken from the measured one). This host's two
vCPUs change placement every few tens of seconds (notebook, session 63), moving one-client
figures by 10-40%, so servers measured one after the other are not measured on the same host.

  .venv/bin/python reports/serving/vllm-cpu-2026-12-07-s63/paired.py c1 9   # rounds
  .venv/bin/python reports/serving/vllm-cpu-2026-12-07-s63/paired.py c64 4

c1: blocks of 5 streamed chats one at a time (128 random tokens' text, 64 out, greedy,
ignore_eos), three arms: ours, vLLM, and `bare` (ours with every process of its cluster but
the ingress and engine replicas stopped: the cluster's background out of the way).
c64: each block a `vllm bench serve` run (openai-chat, random 256/128, 128 prompts, 64
streams), ours and vLLM. vLLM (vllm-cpu 0.32.0) from a scratch venv, $VLLM_VENV.
"""

import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "models" / "small"
OUT = Path(os.environ.get("OUT", Path(__file__).parent))
VENV = Path(os.environ.get("VLLM_VENV", "/work/vllmenv"))
VLLM_PORT = 8100
BLOCK = 5


def start_ours() -> tuple[str, subprocess.Popen]:
    text = (REPO / "deploy.yaml").read_text()
    text = text.replace("model: models/tiny ", f"model: {MODEL} ")
    text = text.replace("served_model_name: tiny ", "served_model_name: small ")
    Path("/tmp/deploy_small.yaml").write_text(text)
    log = OUT / "ours.server.log"
    launch = [
        str(REPO / ".venv/bin/python"),
        "-m",
        "serve_app.deploy.launch",
        "/tmp/deploy_small.yaml",
    ]
    proc = subprocess.Popen(launch, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(300):  # the ingress's own URL, as `make serve` prints it
        found = re.search(r"dynabatch is serving .* at (\S+)", log.read_text())
        if found:
            return found.group(1), proc
        time.sleep(1)
    raise SystemExit("ours never came up")


def vllm_env() -> dict[str, str]:
    """vLLM on the CPU as its server ran in every comparison: both cores bound, Intel's
    OpenMP, a 1 GiB KV cache (engine_pair.py runs its engine the same way)."""
    return dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="0-1",
        LD_PRELOAD=str(VENV / "lib/libiomp5.so"),
    )


def start_vllm() -> tuple[str, subprocess.Popen]:
    env = vllm_env()
    serve = [
        str(VENV / "bin/vllm"),
        "serve",
        str(MODEL),
        "--served-model-name",
        "small",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--port",
        str(VLLM_PORT),
    ]
    log = (OUT / "vllm.server.log").open("w")
    proc = subprocess.Popen(serve, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{VLLM_PORT}/v1"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/models").status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("vLLM never came up")


def tree(proc: subprocess.Popen) -> list[psutil.Process]:
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def signal_all(processes: list[psutil.Process], sig: int) -> None:
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def background(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process of our cluster but the ingress and engine replicas."""
    kept = ("OpenAIIngress", "EngineServer")
    out = []
    for p in tree(proc)[1:]:
        try:
            if not any(k in " ".join(p.cmdline()) for k in kept):
                out.append(p)
        except psutil.Error:
            pass
    return out


def one_chat(url: str, text: str) -> tuple[float, float]:
    """TTFT and TPOT (s) of one streamed chat."""
    body = {
        "model": "small",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
    start, first, tokens = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if (
                first is None
                and chunk.get("choices")
                and chunk["choices"][0]["delta"].get("content")
            ):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return first - start, (end - first) / (tokens - 1)


def bench_block(name: str, url: str, r: int) -> tuple[float, float, float]:
    """tokens/s, median TTFT and TPOT (ms) of one `vllm bench serve` run at 64 streams."""
    result = f"c64_{name}_{r}.json"
    subprocess.run(
        [
            str(VENV / "bin/vllm"),
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--endpoint",
            "/v1/chat/completions",
            "--dataset-name",
            "random",
            "--random-input-len",
            "256",
            "--random-output-len",
            "128",
            "--num-prompts",
            "128",
            "--max-concurrency",
            "64",
            "--ignore-eos",
            "--num-warmups",
            "4",
            "--model",
            "small",
            "--tokenizer",
            str(MODEL),
            "--base-url",
            url.removesuffix("/v1"),
            "--seed",
            str(r),
            "--save-result",
            "--result-dir",
            str(OUT),
            "--result-filename",
            result,
        ],
        capture_output=True,
        check=True,
    )
    d = json.loads((OUT / result).read_text())
    return d["output_throughput"], d["median_ttft_ms"], d["median_tpot_ms"]


def main(mode: str, rounds: int) -> None:
    ours_url, ours = start_ours()
    vllm_url, vllm = start_vllm()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rng = random.Random(1)

    def prompt() -> str:
        return tokenizer.decode(
            [rng.randrange(1000, tokenizer.vocab_size - 100) for _ in range(128)]
        )

    arms = ["ours", "vllm", "bare"] if mode == "c1" else ["ours", "vllm"]
    results: dict[str, list] = {a: [] for a in arms}
    try:
        if mode == "c1":
            for url in (ours_url, vllm_url):
                for _ in range(4):
                    one_chat(url, prompt())
        for r in range(rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            row = []
            for arm in order:
                measured, stopped = (vllm, ours) if arm == "vllm" else (ours, vllm)
                signal_all(tree(measured), signal.SIGCONT)
                signal_all(tree(stopped), signal.SIGSTOP)
                if arm == "bare":
                    signal_all(background(ours), signal.SIGSTOP)
                time.sleep(1.5)
                url = vllm_url if arm == "vllm" else ours_url
                if mode == "c1":
                    block = [one_chat(url, prompt()) for _ in range(BLOCK)]
                    results[arm] += block
                    row.append(
                        f"{arm} TTFT {1e3 * statistics.median(b[0] for b in block):.1f} "
                        f"TPOT {1e3 * statistics.median(b[1] for b in block):.2f}"
                    )
                else:
                    got = bench_block(arm, url, r)
                    results[arm].append(got)
                    row.append(f"{arm} %.1f tok/s TTFT %.0f TPOT %.1f" % got)
            print(time.strftime("%H:%M:%S"), " | ".join(row), flush=True)
    finally:
        for proc in (ours, vllm):
            signal_all(tree(proc), signal.SIGCONT)
    summary: dict[str, object] = {"mode": mode, "rounds": rounds}
    if mode == "c1":
        med = {
            a: (
                1e3 * statistics.median(x[0] for x in results[a]),
                1e3 * statistics.median(x[1] for x in results[a]),
            )
            for a in arms
        }
        for a in ("ours", "bare"):
            summary[a] = {
                "ttft_ms": med[a][0],
                "tpot_ms": med[a][1],
                "ttft_ratio": med[a][0] / med["vllm"][0],
                "tpot_ratio": med[a][1] / med["vllm"][1],
            }
        summary["vllm"] = {"ttft_ms": med["vllm"][0], "tpot_ms": med["vllm"][1]}
    else:
        ours_tps = statistics.median(x[0] for x in results["ours"])
        vllm_tps = statistics.median(x[0] for x in results["vllm"])
        summary |= {
            "ours_tok_s": ours_tps,
            "vllm_tok_s": vllm_tps,
            "ratio": ours_tps / vllm_tps,
            "per_round": [
                a[0] / b[0] for a, b in zip(results["ours"], results["vllm"], strict=True)
            ],
        }
    print(json.dumps(summary))
    (OUT / f"paired_{mode}.json").write_text(json.dumps(summary | {"raw": results}, indent=1))
    vllm.terminate()
    ours.terminate()
    vllm.wait()
    ours.wait()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
