"""The standard benchmark workload: lengths from ../shared/workloads, token ids drawn by seed."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD_DIRS = [REPO.parent / "shared" / "workloads", REPO / "loadtests" / "workloads"]


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # A chat request's one user message: prompt_token_ids are then its chat template applied
    # (what the ingress makes of it), which the in-process side is given.
    chat: str | None = None


def find_workload(name: str) -> Path:
    for d in WORKLOAD_DIRS:
        path = d / f"{name}.json"
        if path.is_file():
            return path
    raise FileNotFoundError(f"workload {name!r} not found in {[str(d) for d in WORKLOAD_DIRS]}")


def load_workload(
    name: str, vocab_size: int, seed: int = 0, limit: int | None = None
) -> list[WorkItem]:
    """A workload file's requests, or `random-IN-OUT-N`: N requests of IN prompt tokens and OUT
    output tokens (vLLM bench's random dataset with fixed lengths)."""
    if name.startswith("random-"):
        prompt_len, max_tokens, count = (int(x) for x in name.split("-")[1:])
        requests = [
            {"id": i, "prompt_len": prompt_len, "max_tokens": max_tokens} for i in range(count)
        ]
        spec = {"requests": requests}
    else:
        spec = json.loads(find_workload(name).read_text())
    rng = random.Random(seed)
    items = []
    for req in spec["requests"][:limit]:
        prompt = [rng.randrange(vocab_size) for _ in range(req["prompt_len"])]
        items.append(WorkItem(str(req["id"]), prompt, req["max_tokens"]))
    return items


def as_chat(items: list[WorkItem], model_dir: str) -> list[WorkItem]:
    """The items as chat requests: each prompt's text as the user's message, its tokens the
    chat template applied to it as the ingress applies it (serve_app/openai/prompts.py), at
    most as many as the item's prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def templated_ids(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        templated = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(templated, add_special_tokens=False)

    chats = []
    for it in items:
        text = tokenizer.decode(it.prompt_token_ids)
        ids = templated_ids(text)
        # Decoded random ids can re-encode into more tokens (a padded vocabulary's ids decode
        # to several characters each): cut the text until the request is no longer than asked.
        for _ in range(8):
            excess = len(ids) - len(it.prompt_token_ids)
            if excess <= 0:
                break
            plain = tokenizer.encode(text, add_special_tokens=False)
            text = tokenizer.decode(plain[: max(1, len(plain) - excess)])
            ids = templated_ids(text)
        chats.append(WorkItem(it.request_id, ids, it.max_tokens, chat=text))
    return chats


def resolve_model(name: str) -> str:
    """`tiny` or `small`: the offline checkpoint under models/ (built on first use); anything
    else: a checkpoint directory, as given."""
    if name not in ("tiny", "small"):
        return name
    from engine.model.tiny_model import make_model

    return str(make_model(REPO / "models" / name, size=name))
