"""One token per sampled row: the temperature-scaled logits, the tokens the row's filters keep,
and the inverse CDF of their probabilities, in vocabulary order, at the row's uniform.

Filters: top-k, then top-p over what top-k kept, and min-p (a ratio to the most likely token,
which no filter drops). They give each row one threshold, and the row keeps every token whose
logit is at least it: tokens tied at the boundary stay or go together, so what a row keeps
depends only on its own logits, never on the batch. On CUDA one Triton kernel draws every row
without sorting (engine/sampling/token_draw_kernel.py); elsewhere, and as the definition that
kernel is tested against, each filtered row is sorted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.sampling_params import SamplingParams
from engine.sampling.transfers import to_device


def draw(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """int64 token ids [rows]: logits [rows, vocab] of rows with temperature > 0, their
    params, and one uniform in (0, 1) per row."""
    if logits.is_cuda:
        return draw_by_search(logits, params, u)
    return draw_by_sort(logits, params, u)


def draw_by_search(
    logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    from engine.sampling.token_draw_kernel import draw as kernel

    return kernel(logits, *columns(params, logits.shape[-1], logits.device), u)[0]


def draw_by_sort(
    logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    return inverse_cdf(kept_probs(logits, params), u)


def kept_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """float32 [rows, vocab]: each row's temperature-scaled probabilities of the tokens its
    filters keep, zero elsewhere, unnormalized (the largest is 1)."""
    device = logits.device
    temperature, top_k, top_p, min_p = columns(params, logits.shape[-1], device)
    scaled = logits.float() / temperature[:, None]
    probs = (scaled - scaled.amax(-1, keepdim=True)).exp()
    filtered = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1 or p.min_p > 0]
    if filtered:
        threshold = torch.full((len(params),), float("-inf"), device=device)
        at = to_device(filtered, device)
        threshold[at] = thresholds_by_sort(scaled[at], top_k[at], top_p[at], min_p[at])
        probs.masked_fill_(scaled < threshold[:, None], 0.0)
    return probs


def columns(
    params: Sequence[SamplingParams], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """temperature, top_k (int64, vocab where unset), top_p and min_p per row, on `device`."""
    return (
        to_device([float(p.temperature) for p in params], device),
        to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device),
        to_device([float(p.top_p) for p in params], device),
        to_device([float(p.min_p) for p in params], device),
    )


def thresholds_by_sort(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """float32 [rows]: the lowest logit each row keeps (the definition, on each row sorted)."""
    vocab = scaled.shape[-1]
    ordered = scaled.sort(dim=-1, descending=True).values
    row_max = ordered[:, :1]
    kth = ordered.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])
    probs = (ordered - row_max).exp().masked_fill(ordered < kth, 0.0)
    running = probs.cumsum(-1)
    # The last token kept is the first whose running sum reaches top_p of the kept mass.
    last = torch.searchsorted(running, top_p[:, None] * running[:, -1:]).clamp_(max=vocab - 1)
    by_top_p = torch.where(top_p[:, None] < 1.0, ordered.gather(1, last), float("-inf"))
    by_min_p = row_max + min_p[:, None].log()
    return torch.maximum(torch.maximum(kth, by_top_p), by_min_p)[:, 0]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first column whose running sum exceeds u x the row's total: never a zero-mass one."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    return picked.clamp_(max=probs.shape[-1] - 1)
