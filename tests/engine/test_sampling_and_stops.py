"""Sampling parameters, stop conditions and detokenization on the real tiny model."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import LLMEngine
from tests.conftest import build_engine

PROMPTS = ["Hello there", "The quick brown fox", "Café", "def step(self):", "x"]


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return build_engine(tiny_model, num_blocks=400, max_num_seqs=16, max_num_batched_tokens=64)


@pytest.fixture(autouse=True)
def cache_is_whole_after_each_test(engine):
    yield
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_blocks


def greedy(max_tokens=20, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_same_seed_same_tokens_whatever_the_batch(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], params)[0].token_ids
    others = [SamplingParams(temperature=0.8, seed=s, max_tokens=12) for s in range(4)]
    batch = engine.generate(PROMPTS[:1] + PROMPTS[1:], [params, *others])
    assert batch[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert engine.generate([PROMPTS[0]], other_seed)[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    want = engine.generate(PROMPTS, greedy(12))
    top_k = SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True)
    top_p = SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(PROMPTS, top_k)] == [r.token_ids for r in want]
    assert [r.token_ids for r in engine.generate(PROMPTS, top_p)] == [r.token_ids for r in want]


def test_high_temperature_sampling_differs_from_greedy(engine):
    want = engine.generate(PROMPTS, greedy(12))
    hot = SamplingParams(temperature=2.0, seed=7, max_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in engine.generate(PROMPTS, hot)] != [r.token_ids for r in want]


def test_max_tokens_ends_with_length(engine):
    res = engine.generate(PROMPTS, greedy(7))
    assert all(len(r.token_ids) == 7 and r.finish_reason == "length" for r in res)


def test_stop_token_ids_and_min_tokens(engine):
    first = engine.generate([PROMPTS[1]], greedy(8))[0].token_ids
    stop_at = first[2]
    res = engine.generate([PROMPTS[1]], greedy(8, stop_token_ids=[stop_at]))[0]
    cut = first.index(stop_at)
    assert res.token_ids == first[: cut + 1] and res.finish_reason == "stop"
    # min_tokens bans the stop token until that many tokens exist.
    held = engine.generate([PROMPTS[1]], greedy(8, stop_token_ids=[stop_at], min_tokens=8))[0]
    assert len(held.token_ids) == 8 and stop_at not in held.token_ids
    assert held.finish_reason == "length"


def test_eos_stops_unless_ignore_eos(engine):
    first = engine.generate([PROMPTS[2]], greedy(10))[0].token_ids
    saved = engine.eos_token_ids
    engine.eos_token_ids = (first[3],)  # as if the checkpoint's EOS were this token
    try:
        stops = SamplingParams(temperature=0.0, max_tokens=10)
        res = engine.generate([PROMPTS[2]], stops)[0]
        cut = first.index(first[3])
        assert res.token_ids == first[: cut + 1] and res.finish_reason == "stop"
        ignores = engine.generate([PROMPTS[2]], greedy(10))[0]
        assert ignores.token_ids == first and ignores.finish_reason == "length"
    finally:
        engine.eos_token_ids = saved


def test_stop_string_cuts_the_text_and_streams_never_show_it(engine):
    full = engine.generate([PROMPTS[0]], greedy(30))[0].text
    assert len(full) > 12
    stop = full[8:12]
    idx = full.index(stop)
    engine.add_request("s", PROMPTS[0], greedy(30, stop=[stop]))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out
    text = "".join(deltas)
    assert text == full[:idx]
    assert stop not in text
    assert final.finish_reason == "stop"


def test_streamed_text_equals_decoding_all_tokens(engine):
    res = engine.generate(PROMPTS, greedy(40))
    for r in res:
        assert r.text == engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)


def test_incremental_detokenizer_never_emits_broken_characters(engine):
    text = "日本語のテキスト 🚀🔥 Café naïve Ångström"
    ids = engine.tokenizer.encode(text)
    detok = IncrementalDetokenizer(engine.tokenizer, [], stop=[])
    pieces = []
    for i, token in enumerate(ids):
        delta, _ = detok.update([token], finished=i == len(ids) - 1)
        assert "\ufffd" not in delta
        pieces.append(delta)
    assert "".join(pieces) == text
    assert any(p == "" for p in pieces), "some token must end mid-character for this to test"
