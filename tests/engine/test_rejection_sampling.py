"""Rejection sampling of drafts drawn from a distribution q (speculative.rejection_sampling):
every kept token follows the target's distribution p (chi-square, as the sampler's tests),
more drafts count than exact matching keeps, and with the draft model it runs end to end."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.sampling.draws import uniforms
from engine.sampling.token_draw import inverse_cdf
from engine.sampling.verification import ACCEPT_SALT, rejection_tokens
from tests.conftest import build_engine
from tests.engine.test_sampler import _chi_square_z
from tests.engine.test_speculative_decoding import greedy, repetitive_prompts, run

VOCAB = 12


def _distributions(seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, VOCAB, generator=g) ** 3
    q = torch.rand(k, VOCAB, generator=g) ** 3
    p[:, 0] = 0.0  # a token the target never draws, which the draft does
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _trials(p: torch.Tensor, q: torch.Tensor, n: int) -> list[list[int]]:
    """n independent verifications of drafts drawn from q (one seed each)."""
    k = q.shape[0]
    seeds = torch.arange(n, dtype=torch.int64)
    out = []
    for j_seed in seeds.tolist():
        s = torch.full((k + 1,), j_seed, dtype=torch.int64)
        counters = torch.arange(k + 1)
        draft_u = uniforms(s ^ 0x2545F491, counters)[:k]
        drafts = inverse_cdf(q, draft_u).tolist()
        accept_u, draw_u = uniforms(s ^ ACCEPT_SALT, counters), uniforms(s, counters)
        out.append(rejection_tokens(p, q, drafts, accept_u, draw_u))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_keeps_the_target_distribution_at_each_position(seed):
    p, q = _distributions(seed, k=2)
    trials = _trials(p, q, 12000)
    first = [0] * VOCAB
    for tokens in trials:
        first[tokens[0]] += 1
    assert abs(_chi_square_z(first, p[0].tolist())) < 4.5
    # The second position, where the first draft counted (p does not depend on the prefix
    # here, so it is p[1] whatever came first).
    second = [0] * VOCAB
    for tokens in trials:
        if len(tokens) >= 2:
            second[tokens[1]] += 1
    assert sum(second) > 1000
    assert abs(_chi_square_z(second, p[1].tolist())) < 4.5
    assert first[0] == 0 and second[0] == 0  # never a token p excludes


def test_rejection_sampling_accepts_as_much_as_the_distributions_overlap():
    p, q = _distributions(3, k=1)
    trials = _trials(p, q, 8000)
    accepted = sum(len(t) - 1 for t in trials) / len(trials)
    overlap = float(torch.minimum(p[0], q[0]).sum())  # the chance a q-draft counts
    assert abs(accepted - overlap) < 0.03
    same = _trials(q[:1].expand(2, VOCAB).contiguous(), q, 500)  # p == q: every draft counts
    assert all(len(t) == 2 for t in same)


def test_draft_model_rejection_sampling_runs_and_keeps_greedy_outputs(tiny_model):
    """The target as its own draft: p == q, so every sampled draft counts (exact matching
    keeps only those equal to the target's own draw); greedy rows are unchanged."""
    prompts = repetitive_prompts(31, 8)
    rng = random.Random(31)
    params = greedy([16] * 4) + [
        SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30), max_tokens=16)
        for _ in range(4)
    ]
    settings = {"method": "draft_model", "model": tiny_model, "adaptive": False}
    plain = run(build_engine(tiny_model), prompts, params)
    engine = build_engine(tiny_model, speculative=settings | {"rejection_sampling": True})
    got = run(engine, prompts, params)
    assert all(got[str(i)] == plain[str(i)] for i in range(4))  # greedy: token for token
    for i in range(4, 8):
        assert len(got[str(i)][0]) == 16 and got[str(i)][2] in ("length", "stop")
    stats = engine.stats().spec
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    kv = engine.scheduler.speculator.proposer.kv
    assert kv.num_free_blocks == kv.num_blocks
    exact = build_engine(tiny_model, speculative=settings)
    run(exact, prompts[4:], params[4:])
    assert exact.stats().spec.num_accepted_tokens < exact.stats().spec.num_draft_tokens


def test_rejection_sampling_is_for_draft_models_only(tiny_model):
    from engine.core.errors import InvalidParam

    with pytest.raises(InvalidParam) as caught:
        build_engine(tiny_model, speculative={"rejection_sampling": True})
    assert caught.value.param == "speculative.rejection_sampling"
