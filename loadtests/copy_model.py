"""A tiny model that copies its context, for a figure of prompt lookup (`method: ngram`) on
text that repeats: random-weight models never repeat themselves, so ngram drafts nothing on
them. The tiny model's shape, trained for half a minute on the CPU on sequences that repeat
a random block of COPY_PERIOD tokens: it learns to say the token COPY_PERIOD - 1 back (one
relative-position attention; random periods would need induction heads, which take far
longer to form), and then continues any such prompt by copying it, as a model quoting a
document does.

    python -m loadtests.copy_model [--out models/tiny-copy] [--steps 500]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from loadtests.workload import REPO, resolve_model

COPY_PERIOD = 16
COPY_TOKENS = (256, 512)  # the ids it is trained on and prompted with
_MARKER = "copy_training.json"


def copy_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, each a random block of COPY_PERIOD ids repeated."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        block = [rng.randrange(*COPY_TOKENS) for _ in range(COPY_PERIOD)]
        prompts.append((block * (length // COPY_PERIOD + 1))[:length])
    return prompts


def copy_model(out: str | Path = REPO / "models" / "tiny-copy", steps: int = 500) -> str:
    """Train (once: reused while its marker says the same steps) and return its directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text())["steps"] == steps:
        return str(out)
    base = resolve_model("tiny")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(base)
    config.initializer_range = 0.02  # HF's default: the tiny model's 0.1 trains slowly
    model = AutoModelForCausalLM.from_config(config).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(0)
    batch, length = 16, 4 * COPY_PERIOD
    loss = torch.tensor(0.0)
    with torch.enable_grad():
        for _ in range(steps):
            blocks = torch.randint(*COPY_TOKENS, (batch, COPY_PERIOD), generator=generator)
            x = blocks.repeat(1, length // COPY_PERIOD)
            logits = model(x).logits[:, COPY_PERIOD - 1 : -1]  # what the first block predicts
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, COPY_PERIOD:].reshape(-1)
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    marker.write_text(json.dumps({"steps": steps, "final_loss": float(loss)}))
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "models" / "tiny-copy"))
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    path = copy_model(args.out, args.steps)
    print(f"{path}: {(Path(path) / _MARKER).read_text()}")


if __name__ == "__main__":
    main()
