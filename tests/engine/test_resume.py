"""A request resumed from its first k output tokens (its replica died) goes on exactly as an
undisturbed run: the same tokens (greedy, and seeded with penalties and stop strings), the
same text after what the client already had, the same counts."""

from __future__ import annotations

import pytest

from engine.core.errors import InvalidParam
from engine.core.request import Resume
from engine.core.sampling_params import SamplingParams
from tests.conftest import build_engine

PROMPT = [1203, 77, 2981, 400, 15, 3003, 9, 41]


def _deltas(engine, request_id, params, resume=None):
    engine.add_prepared(engine.make_request(request_id, PROMPT, params, resume=resume))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            seed=5,
            presence_penalty=0.5,
            repetition_penalty=1.3,
            max_tokens=12,
            min_tokens=10,
            logprobs=2,
        ),
    ],
    ids=["greedy", "seeded-penalized"],
)
@pytest.mark.parametrize("k", [1, 5, 11])
def test_resumed_request_continues_as_the_undisturbed_one(tiny_model, params, k):
    engine = build_engine(tiny_model, 4, 200, max_num_seqs=4, max_num_batched_tokens=16)
    whole = _deltas(engine, "whole", params)
    tokens = [t for o in whole for t in o.new_token_ids]
    text = "".join(o.new_text for o in whole)
    # What the client had after the deltas that carried the first k tokens.
    got, chars = 0, 0
    for o in whole:
        if got + len(o.new_token_ids) > k:
            break
        got += len(o.new_token_ids)
        chars += len(o.new_text)
    rest = _deltas(engine, "rest", params, Resume(tokens[:k], chars))
    assert [t for o in rest for t in o.new_token_ids] == tokens[k:]
    assert text[:chars] + "".join(o.new_text for o in rest) == text
    assert rest[-1].num_output_tokens == len(tokens)
    assert rest[-1].num_prompt_tokens == len(PROMPT)
    assert rest[-1].finish_reason == whole[-1].finish_reason
    if params.logprobs is not None:
        want = [lp.logprob for o in whole for lp in o.logprobs][k:]
        assert [lp.logprob for o in rest for lp in o.logprobs] == pytest.approx(want, abs=1e-5)


def test_a_stop_string_split_across_the_resume_point_still_stops(tiny_model):
    engine = build_engine(tiny_model, 4, 200)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    whole = _deltas(engine, "plain", plain)
    text = "".join(o.new_text for o in whole)
    tokens = [t for o in whole for t in o.new_token_ids]
    stop = text[3:9]  # ends some tokens in
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    stopped = _deltas(engine, "stopped", params)
    want = "".join(o.new_text for o in stopped)
    assert want == text[: text.find(stop)]
    # Resumed after the first token, of whose text the holdback kept some from the client.
    assert stopped[0].new_token_ids == tokens[:1]
    rest = _deltas(engine, "rest", params, Resume(tokens[:1], len(stopped[0].new_text)))
    assert stopped[0].new_text + "".join(o.new_text for o in rest) == want
    assert rest[-1].finish_reason == "stop"


def test_a_resume_past_max_tokens_or_outside_the_vocabulary_is_refused(tiny_model):
    engine = build_engine(tiny_model, 4, 200)
    params = SamplingParams(max_tokens=3)
    for resume in (Resume([1, 2, 3], 0), Resume([10**9], 0)):
        with pytest.raises(InvalidParam) as err:
            engine.make_request("r", PROMPT, params, resume=resume)
        assert err.value.param == "resume"
