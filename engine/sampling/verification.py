"""Verifying drafts by drawing the target at each drafted position, as if decoding.

A row with k drafts computes its last token and the drafts in one forward, so the step has
the target's logits at k + 1 positions. Each position is sampled like the decode step it
stands in for: its own counter (output token n + j, engine/sampling/draws.py), its penalties
over the tokens before it (drafts included), stop tokens banned while below min_tokens. The
drafts count while each equals the draw at the position before it; the first draw that
differs replaces its draft, and where all k count the draw after them is the bonus token.
Every kept token is the token decoding without drafts would have produced there, so with a
deterministic proposer (ngram) the output is identical, token for token, at any temperature.

A draft model that samples its drafts (speculative.rejection_sampling) is verified by
standard speculative sampling instead (`rejection_tokens`): outputs follow the target's
distribution, more drafts count at high temperature, but they are not token-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.core.outputs import ScheduledRequest
from engine.sampling.token_draw import inverse_cdf

if TYPE_CHECKING:
    from engine.sampling.sampler import Sampler

# The acceptance tests' uniforms: a stream of the request's seed apart from its draws'.
ACCEPT_SALT = 0x5BD1E995


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


def rejection_tokens(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: list[int],
    accept_u: torch.Tensor,
    draw_u: torch.Tensor,
) -> list[int]:
    """Speculative sampling for one row whose drafts were drawn from a distribution q:
    `p` [k + 1, vocab] the target's probabilities at the row's positions, `q` [k, vocab] the
    draft's at its drafts (rows summing to 1), `accept_u` and `draw_u` [k + 1] uniforms of two
    streams. Draft j counts with probability min(1, p_j(d) / q_j(d)); the first that does not
    is replaced by a draw from max(0, p_j - q_j), normalized; where all count, the bonus token
    is drawn from p_k. Each kept token is then distributed as the target's p at its position
    (Leviathan et al., 2023), though not the token decoding without drafts would have drawn."""
    k = len(drafts)
    at, ids = torch.arange(k, device=p.device), torch.tensor(drafts, device=p.device)
    counts = (accept_u[:k] * q[at, ids] < p[at, ids]).tolist()
    for j, counted in enumerate(counts):
        if not counted:
            residual = (p[j] - q[j]).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p <= q everywhere: only rounding left
                residual = p[j]
            return drafts[:j] + [int(inverse_cdf(residual[None], draw_u[j : j + 1])[0])]
    return drafts + [int(inverse_cdf(p[k : k + 1], draw_u[k : k + 1])[0])]


def rejection_verified(
    sampler: Sampler,
    logits: torch.Tensor,
    sampled: list[ScheduledRequest],
    order: list[ScheduledRequest],
    draft_probs: Callable[[str], torch.Tensor | None],
) -> dict[str, list[int]]:
    """The tokens of the rows whose drafts were sampled (`draft_probs` has their q), by
    `rejection_tokens`; `sampled` holds the step's sampled rows (k + 1 per row with drafts, in
    `order`) and `logits` theirs, which this leaves as they were."""
    decided: dict[str, list[int]] = {}
    start = 0
    for row in order:
        if not row.sample:
            continue
        n = 1 + row.num_drafts
        q = draft_probs(row.request_id) if row.num_drafts else None
        if q is not None:
            rows = sampled[start : start + n]
            p = sampler.probabilities(logits[start : start + n].clone(), rows)
            accept_u = sampler.row_uniforms(rows, p.device, ACCEPT_SALT)
            draw_u = sampler.row_uniforms(rows, p.device)
            drafts = row.token_ids[-row.num_drafts :]
            decided[row.request_id] = rejection_tokens(p, q, drafts, accept_u, draw_u)
        start += n
    return decided
