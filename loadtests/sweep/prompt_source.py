"""Seeded prompts as token ids, with exact lengths on any model (the sweep's workloads)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from cluster.workload import CHAT_OUTPUT, CHAT_PROMPT, LengthDist


@dataclass(frozen=True)
class PromptSpec:
    kind: str = "chat"  # fixed | uniform | chat | shared-prefix
    prompt_len: int = 128  # fixed; uniform's upper end; shared-prefix's suffix
    output_len: int = 64  # fixed; uniform's upper end
    prefix_len: int = 256  # shared-prefix: the common prefix
    token_lo: int = 32
    token_hi: int = 1000
    context_len: int = 2048  # prompt + output cap: the server's max_model_len


class PromptSource:
    """Seeded prompts (token ids) and max_tokens; never longer than the spec's context_len."""

    def __init__(self, spec: PromptSpec, seed: int = 0) -> None:
        if spec.kind not in ("fixed", "uniform", "chat", "shared-prefix"):
            raise ValueError(f"workload must be fixed, uniform, chat or shared-prefix: {spec.kind}")
        self.spec = spec
        self.rng = random.Random(seed)
        self.prefix = self._ids(spec.prefix_len) if spec.kind == "shared-prefix" else []

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.spec.token_lo, self.spec.token_hi) for _ in range(n)]

    def lengths(self) -> tuple[int, int]:
        s = self.spec
        if s.kind == "chat":
            return CHAT_PROMPT.sample(self.rng), CHAT_OUTPUT.sample(self.rng)
        if s.kind == "uniform":
            return (
                LengthDist("uniform", 1, s.prompt_len).sample(self.rng),
                LengthDist("uniform", 1, s.output_len).sample(self.rng),
            )
        return s.prompt_len, s.output_len

    def next(self) -> tuple[list[int], int]:
        n_prompt, n_out = self.lengths()
        room = self.spec.context_len - len(self.prefix)
        n_prompt = max(1, min(n_prompt, room - 2))
        n_out = max(1, min(n_out, room - n_prompt))
        return self.prefix + self._ids(n_prompt), n_out
