"""Structured outputs in the engine: with random weights only the grammar can make the output
valid, so every constrained output must parse and validate; requests without a grammar keep
their tokens whatever grammar requests share their steps."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from engine.core.errors import InvalidParam
from engine.core.sampling_params import SamplingParams, StructuredOutput
from loadtests.json_schemas import random_schema
from tests.conftest import build_engine


@pytest.fixture(scope="module")
def engine(tiny_model):
    return build_engine(tiny_model, num_blocks=2000, max_num_seqs=128)


def test_a_hundred_schemas_all_parse_and_validate(engine):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(100)]
    prompts = [[rng.randrange(4096) for _ in range(rng.randint(1, 12))] for _ in schemas]
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 1.0]),
            seed=i,
            max_tokens=600,
            structured=StructuredOutput("json", json.dumps(schema)),
        )
        for i, schema in enumerate(schemas)
    ]
    results = engine.generate(prompts, params)
    for schema, result in zip(schemas, results, strict=True):
        assert result.finish_reason == "stop", (schema, result.text)
        jsonschema.validate(json.loads(result.text), schema)
    assert len(engine.grammar_bank()) == 0  # every request's matcher let go
    engine.add_request("aborted", [1, 2], params[0])
    engine.step()
    engine.abort("aborted")
    assert len(engine.grammar_bank()) == 0


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutput("regex", r"[a-f]{3}-\d{2,4}"), re.compile(r"[a-f]{3}-\d{2,4}").fullmatch),
        (
            StructuredOutput("choice", choices=("yes", "no", "maybe")),
            {"yes", "no", "maybe"}.__contains__,
        ),
        (
            StructuredOutput("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
            re.compile(r"\(\d+(\+\d+)*\)").fullmatch,
        ),
    ],
)
def test_each_kind_of_grammar_holds_the_output(engine, spec, check):
    # Any JSON object may nest without end: a bias towards "}" lets random weights finish one.
    bias = {engine.tokenizer.convert_tokens_to_ids("}"): 4.0} if spec.kind == "json_object" else {}
    params = [
        SamplingParams(
            temperature=t, seed=s, max_tokens=400, ignore_eos=True, logit_bias=bias, structured=spec
        )
        for t, s in ((0.0, None), (1.0, 1), (1.0, 2))
    ]
    for result in engine.generate([[5, 6, 7], [8, 9], [10]], params):
        assert result.finish_reason == "stop" and check(result.text), result.text


def test_plain_requests_keep_their_tokens_beside_grammar_requests(engine):
    rng = random.Random(1)
    plain = [[rng.randrange(4096) for _ in range(8)] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = engine.generate(plain, greedy)
    schema = StructuredOutput("json", json.dumps(random_schema(rng)))
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=200, structured=schema)
    mixed = engine.generate(plain + plain[:4], [greedy] * 6 + [constrained] * 4)
    assert [r.token_ids for r in mixed[:6]] == [r.token_ids for r in alone]


def test_a_resumed_request_keeps_to_its_grammar(engine):
    """Failover: the new replica's matcher is fed the output the client already has."""
    from engine.core.request import Resume

    spec = StructuredOutput("json", json.dumps({"type": "array", "items": {"type": "integer"}}))
    params = SamplingParams(temperature=0.0, max_tokens=300, structured=spec)
    (whole,) = engine.generate([[3, 4, 5]], params)
    assert whole.finish_reason == "stop" and len(whole.token_ids) > 1
    done = whole.token_ids[: len(whole.token_ids) // 2]
    text = engine.tokenizer.decode(done)
    request = engine.make_request("resumed", [3, 4, 5], params, resume=Resume(done, len(text)))
    engine.add_prepared(request)
    rest = []
    while engine.has_unfinished_requests():
        rest += [t for out in engine.step() for t in out.new_token_ids]
    assert done + rest == whole.token_ids
    bad = engine.make_request("bad", [3], params, resume=Resume([5, 5], 2))  # not JSON
    with pytest.raises(InvalidParam, match="resume"):
        engine.add_prepared(bad)
    # An output that has ended already (its stop token, or its grammar's end) is refused:
    # resuming it would sample past the end.
    with pytest.raises(InvalidParam, match="resume"):
        engine.make_request("ended", [3, 4, 5], params, resume=Resume(whole.token_ids, 0))
    no_eos = SamplingParams(temperature=0.0, max_tokens=300, structured=spec, ignore_eos=True)
    ended = engine.make_request("ended", [3, 4, 5], no_eos, resume=Resume(whole.token_ids, 0))
    with pytest.raises(InvalidParam, match="resume: the output so far already ends"):
        engine.add_prepared(ended)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        (StructuredOutput("json", '{"type": "nonsense"}'), "response_format"),
        (StructuredOutput("json", "{not json"), "response_format"),
        (StructuredOutput("regex", "(", param="guided_regex"), "guided_regex"),
        (StructuredOutput("grammar", "root ::= ", param="structured_outputs.grammar"), None),
    ],
)
def test_a_bad_grammar_names_its_field(engine, spec, param):
    with pytest.raises(InvalidParam) as info:
        engine.make_request("x", [1, 2], SamplingParams(structured=spec))
    assert info.value.param == (param or spec.param)
    assert "invalid" in str(info.value)
