"""One client, one kept-alive connection: N streamed chats one at a time (128 random tokens'
text, 64 out, greedy); prints the median TTFT (to the first data event) and TPOT, ms.

  python one_client.py http://127.0.0.1:PORT/v1 30
"""

import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

TOKENIZER = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[3] / "models" / "small")


class OneClient:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.Client(timeout=60)
        self.rng = random.Random(time.time_ns())  # fresh prompts: nothing from the prefix cache

    def text(self) -> str:
        """A fresh prompt: 128 random tokens' text."""
        ids = [self.rng.randrange(1000, TOKENIZER.vocab_size - 100) for _ in range(128)]
        return TOKENIZER.decode(ids)

    def body(self) -> dict:
        """One streamed chat's request, on a fresh prompt."""
        return {
            "model": "small",
            "messages": [{"role": "user", "content": self.text()}],
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.0,
        }

    def chat(self) -> tuple[float, float]:
        """TTFT and TPOT (ms) of one streamed chat."""
        body = self.body()
        start, first = time.perf_counter(), None
        with self.client.stream("POST", f"{self.url}/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        return (first - start) * 1e3, (end - first) * 1e3 / 63


if __name__ == "__main__":
    one = OneClient(sys.argv[1])
    for _ in range(3):
        one.chat()
    rows = [one.chat() for _ in range(int(sys.argv[2]))]
    ttft = statistics.median(r[0] for r in rows)
    print(f"TTFT {ttft:.1f} TPOT {statistics.median(r[1] for r in rows):.2f}")
