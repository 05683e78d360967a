"""Verifying drafts by drawing the target at each drafted position, as if decoding.

A row with k drafts computes its last token and the drafts in one forward, so the step has
the target's logits at k + 1 positions. Each position is sampled like the decode step it
stands in for: its own counter (output token n + j, engine/sampling/draws.py), its penalties
over the tokens before it (drafts included), stop tokens banned while below min_tokens. The
drafts count while each equals the draw at the position before it; the first draw that
differs replaces its draft, and where all k count the draw after them is the bonus token.
Every kept token is the token decoding without drafts would have produced there, so with a
deterministic proposer (ngram) the output is identical, token for token, at any temperature.
"""

from __future__ import annotations

from dataclasses import replace

from engine.core.outputs import ScheduledRequest


def verification_rows(row: ScheduledRequest) -> list[ScheduledRequest]:
    """The k + 1 sampled rows of a row with k drafts, in position order (the row itself
    where it has none)."""
    k = row.num_drafts
    if not k:
        return [row]
    drafts = row.token_ids[-k:]
    banned, first = row.banned_token_ids, row.num_output_tokens
    min_tokens = row.sampling_params.min_tokens
    seen = row.seen_token_ids
    return [
        replace(
            row,
            num_output_tokens=first + j,
            banned_token_ids=banned if first + j < min_tokens else (),
            seen_token_ids=None if seen is None else seen + drafts[:j],
        )
        for j in range(k + 1)
    ]


def accepted_tokens(drafts: list[int], draws: list[int]) -> list[int]:
    """The tokens a row with `drafts` gains from the target's `draws` at its k + 1 positions:
    the drafts up to the first that differs from its position's draw, then that draw."""
    for j, draft in enumerate(drafts):
        if draws[j] != draft:
            return draws[: j + 1]
    return draws[: len(drafts) + 1]
