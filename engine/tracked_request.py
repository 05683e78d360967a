"""What the engine keeps of each request it serves beside the scheduler's record."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.outputs import TokenLogprob
from engine.core.request import Request
from engine.detokenizer import IncrementalDetokenizer


@dataclass
class TrackedRequest:
    request: Request
    detokenizer: IncrementalDetokenizer
    # When the request asks: filled by position as its prompt computes (a recomputed chunk
    # writes the same values again), sent on its first delta, then dropped.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken


def logprobs_of(
    logprobs: dict[str, TokenLogprob], request_id: str, new_token_ids: list[int]
) -> list[TokenLogprob] | None:
    entry = logprobs.get(request_id)
    return [entry] if entry is not None and new_token_ids else None
