"""The requests of one serving benchmark, as vLLM's `bench serve` draws them: `random` (token
ids of fixed lengths, seeded) or `sharegpt` (the first human turn of each conversation of a
ShareGPT-format JSON file as the prompt, the reply's token count as max_tokens)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's ShareGPT filter: prompts and replies under 4 tokens are dropped, and so are pairs
# that would not fit a 2048-token context or whose prompt passes 1024 tokens.
_MIN_LEN, _MAX_PROMPT, _MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions only)
    prompt_len: int  # tokens, as the server's tokenizer counts them
    output_len: int  # max_tokens (sent with ignore_eos)


def random_requests(
    count: int, input_len: int, output_len: int, vocab: tuple[int, int], seed: int
) -> list[BenchRequest]:
    """`count` prompts of `input_len` token ids drawn from [lo, hi)."""
    rng = random.Random(seed)
    lo, hi = vocab
    return [
        BenchRequest([rng.randrange(lo, hi) for _ in range(input_len)], input_len, output_len)
        for _ in range(count)
    ]


def sharegpt_requests(
    path: Path, count: int, tokenize, seed: int, output_len: int | None = None
) -> list[BenchRequest]:
    """`count` conversations drawn (seeded) from a ShareGPT-format file; `tokenize(text)` counts
    tokens with the server's tokenizer. `output_len` overrides the replies' lengths."""
    conversations: list[dict[str, Any]] = json.loads(path.read_text())
    pairs = [
        (c["conversations"][0]["value"], c["conversations"][1]["value"])
        for c in conversations
        if len(c.get("conversations", [])) >= 2
    ]
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) == count:
            break
        prompt_len = len(tokenize(prompt))
        reply_len = output_len or len(tokenize(reply))
        too_short = prompt_len < _MIN_LEN or reply_len < _MIN_LEN
        if too_short or prompt_len > _MAX_PROMPT or prompt_len + reply_len > _MAX_TOTAL:
            continue
        requests.append(BenchRequest(prompt, prompt_len, reply_len))
    if len(requests) < count:
        raise SystemExit(f"{path}: only {len(requests)} usable conversations, {count} asked")
    return requests
