"""The CUDA path's draw kernel, run by Triton's interpreter, keeps exactly the tokens the
sorted definition keeps (ties and masked tokens included) and draws the same token at the same
uniform; and the definition keeps what top-k, top-p and min-p say."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.sampling.token_draw import draw_by_sort, thresholds_by_sort  # noqa: E402

VOCAB = 1500
# (top_k, top_p, min_p): each filter alone, combined, at its extremes, and none.
FILTERS = [
    (VOCAB, 0.9, 0.0),
    (1, 1.0, 0.0),
    (40, 1.0, 0.0),
    (VOCAB - 1, 1.0, 0.0),
    (50, 0.5, 0.0),
    (VOCAB, 1e-9, 0.0),
    (VOCAB, 0.999, 0.0),
    (VOCAB, 1.0, 0.2),
    (7, 0.8, 0.05),
    (VOCAB, 1.0, 0.0),
]


def _columns(filters):
    top_k, top_p, min_p = zip(*filters, strict=True)
    return torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p)


def _logits(seed: int) -> torch.Tensor:
    """Peaked, flat, bfloat16-rounded (many ties) and partly masked rows."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(FILTERS), VOCAB, generator=g)
    rows[0::4] *= 4.0
    rows[1::4] *= 0.2
    rows[2::4] = rows[2::4].to(torch.bfloat16).float()
    rows[3::4, : VOCAB // 3] = float("-inf")
    return rows


def _kept(logits: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    return logits >= thresholds[:, None]


def test_the_kernel_keeps_and_draws_what_the_sorted_definition_does():
    from engine.sampling.token_draw_kernel import draw

    params = [
        SamplingParams(temperature=t, top_k=k if k < VOCAB else 0, top_p=p, min_p=m)
        for (k, p, m), t in zip(FILTERS, [1.0, 0.5, 1.3, 1.0, 0.8] * 2, strict=True)
    ]
    temperature = torch.tensor([p.temperature for p in params])
    for seed in range(2):
        logits = _logits(seed)
        u = torch.rand(len(FILTERS), generator=torch.Generator().manual_seed(seed))
        tokens, thresholds = draw(logits, temperature, *_columns(FILTERS), u)
        scaled = logits / temperature[:, None]
        defined = _kept(scaled, thresholds_by_sort(scaled, *_columns(FILTERS)))
        searched = _kept(scaled, thresholds)
        assert torch.equal(searched, defined), (seed, (searched != defined).sum(-1).tolist())
        assert torch.equal(tokens, draw_by_sort(logits, params, u))
        assert searched.gather(1, tokens[:, None]).all()


def test_the_definition_keeps_what_each_filter_says():
    logits = _logits(7)
    for row, (top_k, top_p, min_p) in enumerate(FILTERS):
        x = logits[row]
        kept = _kept(x[None], thresholds_by_sort(x[None], *_columns([(top_k, top_p, min_p)])))[0]
        values = sorted(x.tolist(), reverse=True)
        by_k = x >= values[top_k - 1]  # ties at the k-th value stay with it
        probs = (x - x.max()).exp() * by_k
        probs /= probs.sum()
        ranked = sorted(range(VOCAB), key=lambda i: -probs[i].item())
        # top-p: the fewest leading tokens whose mass reaches top_p, and their ties
        mass, last = 0.0, ranked[0]
        for i in ranked:
            mass, last = mass + probs[i].item(), i
            if mass >= top_p * (1 - 1e-6):
                break
        by_p = x >= x[last] if top_p < 1.0 else torch.ones_like(by_k)
        by_min_p = probs >= min_p * probs.max() * (1 - 1e-6)
        expected = by_k & by_p & by_min_p
        assert torch.equal(kept, expected), (row, kept.sum().item(), expected.sum().item())
        assert kept[x.argmax()]  # the most likely token stays under any filter
