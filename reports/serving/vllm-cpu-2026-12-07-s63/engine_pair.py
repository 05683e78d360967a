"""Our engine and vLLM's in process, both loaded at once, alternating blocks of 6 prompts
(142 random token ids each: max_tokens=1, then 32 on the same prompt), so both engines are
timed on the same host state (session 63: this host's vCPU placement moves every few tens of
seconds).

  .venv/bin/python reports/serving/vllm-cpu-2026-12-07-s63/engine_pair.py 10   # rounds

It runs itself twice as a worker (`worker ours` under .venv's Python, `worker vllm` under
$VLLM_VENV's), each reading "COUNT SEED" lines and answering each with a JSON list of
[prefill s, 32-token call s] per prompt.
"""

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "models" / "small"
VENV = Path(os.environ.get("VLLM_VENV", "/work/vllmenv"))


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 16000) for _ in range(142)] for _ in range(count)]


def worker_ours() -> None:
    sys.path.insert(0, str(REPO))
    from engine.async_engine import AsyncLLMEngine
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from loadtests.serve_bench import deploy_args

    args = deploy_args(str(REPO / "deploy.yaml"), {"model": str(MODEL), "served_model_name": "s"})

    async def serve() -> None:
        engine = AsyncLLMEngine.built(lambda: LLMEngine(args.engine.engine_config(args.model)))
        loop, calls = asyncio.get_running_loop(), 0
        print("ready", flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            times = []
            for prompt in prompts(*map(int, line.split())):
                marks = [time.perf_counter()]
                for max_tokens in (1, 32):
                    calls += 1
                    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                    async for _ in engine.generate(prompt, params, f"r{calls}"):
                        pass
                    marks.append(time.perf_counter())
                times.append([marks[1] - marks[0], marks[2] - marks[1]])
                await asyncio.sleep(0.02)
            print(json.dumps(times), flush=True)

    asyncio.run(serve())


def worker_vllm() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(MODEL), dtype="float32", max_model_len=1024)
    print("ready", flush=True)
    for line in sys.stdin:
        times = []
        for prompt in prompts(*map(int, line.split())):
            marks = [time.perf_counter()]
            for max_tokens in (1, 32):
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
                marks.append(time.perf_counter())
            times.append([marks[1] - marks[0], marks[2] - marks[1]])
            time.sleep(0.02)
        print(json.dumps(times), flush=True)


def main(rounds: int) -> None:
    from paired import vllm_env  # beside this script

    workers = {
        "ours": subprocess.Popen(
            [str(REPO / ".venv/bin/python"), __file__, "worker", "ours"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ),
        "vllm": subprocess.Popen(
            [str(VENV / "bin/python"), __file__, "worker", "vllm"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=vllm_env(),
            stderr=subprocess.DEVNULL,
        ),
    }
    for proc in workers.values():
        while not proc.stdout.readline().startswith("ready"):
            pass
    times: dict[str, list[list[float]]] = {name: [] for name in workers}
    for r in range(rounds):
        row = []
        for name in ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours"):
            proc = workers[name]
            proc.stdin.write(f"6 {r}\n")
            proc.stdin.flush()
            block = json.loads(proc.stdout.readline())[1:]  # the first: a warm-up
            times[name] += block
            prefill = 1e3 * statistics.median(t[0] for t in block)
            row.append(f"{name} {prefill:.1f} / {1e3 * statistics.median(t[1] for t in block):.1f}")
        print(time.strftime("%H:%M:%S"), "prefill / 32-token call, ms:", " | ".join(row))
    for name, got in times.items():
        prefill, call = (1e3 * statistics.median(t[i] for t in got) for i in (0, 1))
        print(f"{name}: prefill {prefill:.1f} ms, 32-token call {call:.1f} ms")
    for proc in workers.values():
        proc.kill()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker_ours() if sys.argv[2] == "ours" else worker_vllm()
    else:
        main(int(sys.argv[1]))
