"""The batched sampler: counter-based draws, top-k / top-p / min-p against their definitions
(chi-square), and a request's tokens independent of its batch, its batch order, the engine's
own seed, and of where it resumes."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.sampling.draws import uniforms
from engine.sampling.sampler import Sampler, adjust_logits


def _request(rid: str, params: SamplingParams, n: int = 0) -> ScheduledRequest:
    return ScheduledRequest(rid, [1], 5, [0], True, params, n)


def _chi_square_z(counts: list[int], probs: list[float]) -> float:
    """Wilson-Hilferty z of Pearson's statistic over the cells with mass (about N(0, 1) when
    the counts follow probs)."""
    total = sum(counts)
    cells = [(c, p * total) for c, p in zip(counts, probs, strict=True) if p > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    k = len(cells) - 1
    return ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))


def test_uniforms_depend_only_on_seed_and_counter_and_look_uniform():
    seeds = torch.tensor([0, -1, 2**62 + 12345, 7, 7])
    counters = torch.tensor([0, 0, 3, 0, 1])
    u = uniforms(seeds, counters)
    assert ((u > 0) & (u < 1)).all()
    assert u[3] != u[4] and u[0] != u[1]
    for i in range(5):  # alone, or among others: the same number
        assert uniforms(seeds[i : i + 1], counters[i : i + 1]) == u[i]
    many = uniforms(torch.full((200_000,), 42), torch.arange(200_000))
    counts = torch.histc(many, bins=20, min=0, max=1).long().tolist()
    assert abs(_chi_square_z(counts, [0.05] * 20)) < 4.5
    # Neighbouring seeds are unrelated streams.
    a, b = (
        uniforms(torch.full((1000,), 5), torch.arange(1000)),
        uniforms(torch.full((1000,), 6), torch.arange(1000)),
    )
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.1


LOGITS = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])


def _expected(params: SamplingParams) -> list[float]:
    """The filters' definitions, on the temperature-scaled softmax."""
    probs = (LOGITS / params.temperature).softmax(-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(ranked[: params.top_k] if params.top_k > 0 else ranked)
    mass = sum(probs[i] for i in keep)
    covered = 0.0
    for i in ranked:  # top-p over what top-k kept: keep while the ones above cover < top_p
        if i in keep:
            if covered >= params.top_p * mass:
                keep.discard(i)
            covered += probs[i]
    keep = {i for i in keep if probs[i] >= params.min_p * max(probs)}
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.0, top_k=4, seed=3),
        SamplingParams(temperature=1.3, top_p=0.8, seed=3),
        SamplingParams(temperature=1.0, min_p=0.2, seed=3),
        SamplingParams(temperature=1.0, top_k=6, top_p=0.9, min_p=0.05, seed=3),
    ],
    ids=["t1", "t0.7", "top_k", "top_p", "min_p", "all"],
)
def test_draws_follow_the_filtered_distribution(params):
    n = 30_000
    requests = [_request("r", params, i) for i in range(n)]  # one request's first n draws
    tokens = Sampler().sample(LOGITS.repeat(n, 1), requests)
    want = _expected(params)
    counts = [tokens.count(i) for i in range(len(want))]
    assert all(c == 0 for c, p in zip(counts, want, strict=True) if p == 0)
    assert abs(_chi_square_z(counts, want)) < 4.5, (counts, want)


def _mixed_batch(seed: int) -> tuple[list[ScheduledRequest], torch.Tensor]:
    rng = random.Random(seed)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.8, top_p=0.9, seed=12),
        SamplingParams(temperature=1.2, top_k=50, min_p=0.01, seed=13),
        SamplingParams(temperature=1.0),  # unseeded: the engine draws it a seed
    ]
    requests = [_request(f"r{i}", kinds[i % 5], rng.randint(0, 40)) for i in range(10)]
    logits = torch.randn(10, 1000, generator=torch.Generator().manual_seed(seed)) * 3
    return requests, logits


def test_a_requests_token_is_the_same_alone_in_any_batch_and_any_order():
    requests, logits = _mixed_batch(0)
    sampler = Sampler()
    together = sampler.sample(logits.clone(), requests)
    alone = [sampler.sample(logits[i : i + 1].clone(), [r])[0] for i, r in enumerate(requests)]
    assert together == alone
    order = list(range(10))
    random.Random(1).shuffle(order)
    shuffled = sampler.sample(logits[order].clone(), [requests[i] for i in order])
    assert shuffled == [together[i] for i in order]
    assert together[0] == int(logits[0].argmax())


def test_seeded_requests_resume_anywhere_with_the_same_draws():
    """Another engine (another engine seed, another replica) sampling the same logits for the
    same request at draw n gives the same token: a request resumed from its first k tokens
    draws what it would have drawn."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=2024)
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(4)) * 2

    def draw(engine_seed: int, rid: str, n: int) -> int:
        return Sampler(seed=engine_seed).sample(logits.clone(), [_request(rid, params, n)])[0]

    first = [draw(0, "a", n) for n in range(40)]
    resumed = [draw(99, "b", n) for n in range(12, 40)]
    assert resumed == first[12:]
    assert len(set(first)) > 5  # the draws move with the counter


def test_unseeded_requests_keep_their_engine_drawn_seed_until_forgotten():
    sampler = Sampler(seed=5)
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, 10_000)  # uniform: distinct draws almost surely differ
    a = [sampler.sample(logits.clone(), [_request("u", params, 0)])[0] for _ in range(2)]
    assert a[0] == a[1]  # the same request, the same draw index: the same token
    sampler.forget(["u"])
    b = sampler.sample(logits.clone(), [_request("u", params, 0)])[0]
    assert b != a[0]


def test_penalties_and_biases_follow_their_definitions():
    """presence: minus once per generated token; frequency: minus per occurrence;
    repetition: positive logits divided, negative multiplied, for prompt and output tokens;
    logit_bias: added. Rows that set none are left alone."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]).repeat(3, 1)
    prompt, output = [0, 1], [3, 3, 2]
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias={5: 4.0}
    )
    penalized = ScheduledRequest("p", [2], 4, [0], True, params, 3, (), prompt + output)
    biased = _request("b", SamplingParams(logit_bias={1: -3.0, 4: 1.5}))
    plain = _request("n", SamplingParams())
    out = logits.clone()
    adjust_logits(out, [penalized, biased, plain])
    want = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0 / 2 - 0.5 - 0.5, -2.0, 1.0 + 4.0]
    torch.testing.assert_close(out[0], torch.tensor(want))
    torch.testing.assert_close(out[1], torch.tensor([2.0, -4.0, 0.5, 3.0, -0.5, 1.0]))
    assert torch.equal(out[2], logits[2])


def test_a_large_logit_bias_decides_greedy_and_random_draws():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    bias = {17: 100.0}
    requests = [
        _request("g", SamplingParams(temperature=0.0, logit_bias=bias)),
        _request("r", SamplingParams(temperature=1.0, seed=1, logit_bias=bias)),
    ]
    assert Sampler().sample(logits, requests) == [17, 17]


def test_the_most_likely_token_survives_any_filter():
    """top_p of 1e-45 is 0 in float32 (and flushed where denormals are): the top token
    still stays, so the draw is the argmax."""
    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0)) * 3
    requests = [
        _request("p", SamplingParams(temperature=1.0, top_p=1e-45, seed=1)),
        _request("m", SamplingParams(temperature=1.0, min_p=1.0, seed=2)),
        _request("k", SamplingParams(temperature=1.0, top_k=1, seed=3)),
    ]
    assert Sampler().sample(logits.clone(), requests) == logits.argmax(-1).tolist()
