"""Speculation with a draft model (`method: draft_model`): the draft's greedy drafts change
no output, through chunked prefill, preemption by recompute and swap; the draft's own KV
blocks all come back; a draft with another vocabulary or tokenizer fails at start naming
`speculative.model`."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.core.errors import InvalidParam
from engine.model.tiny_model import make_model
from engine.model.truncated_draft import make_truncated_draft
from tests.conftest import build_engine
from tests.engine.test_speculative_decoding import (
    greedy,
    repetitive_prompts,
    run,
    sampled,
    spec_scenario_engine,
)


@pytest.fixture(scope="module")
def truncated_draft(tiny_model, tmp_path_factory) -> str:
    return str(make_truncated_draft(tiny_model, 2, tmp_path_factory.mktemp("draft") / "d"))


def draft_settings(model: str) -> dict:
    return {"method": "draft_model", "model": model, "adaptive": False}


def draft_blocks_all_back(engine) -> None:
    kv = engine.scheduler.speculator.proposer.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


@pytest.mark.parametrize("scenario", ["roomy", "chunked-prefill", "chunked+preemption", "swap"])
@pytest.mark.parametrize("draft", ["self", "truncated"])
def test_draft_model_drafts_change_no_token(tiny_model, truncated_draft, scenario, draft):
    """The target as its own draft: every greedy draft counts, sampled rows reject some;
    a two-layer cut of it: mostly rejected. Either way the output is the output."""
    prompts = repetitive_prompts(23, 8)
    params = greedy([20] * 4) + sampled(4, seed=23)
    settings = draft_settings(tiny_model if draft == "self" else truncated_draft)

    plain = run(spec_scenario_engine(tiny_model, scenario), prompts, params)
    spec_engine = spec_scenario_engine(tiny_model, scenario, speculative=settings)
    assert run(spec_engine, prompts, params) == plain
    stats = spec_engine.stats().spec
    assert stats.num_draft_tokens > 0
    if draft == "self":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    draft_blocks_all_back(spec_engine)


def test_a_draft_with_another_tokenizer_or_vocabulary_fails_at_start(tiny_model, tmp_path):
    other_tokenizer = make_model(tmp_path / "seed1", "tiny", seed=1)
    with pytest.raises(InvalidParam, match="tokenizer") as caught:
        build_engine(tiny_model, speculative=draft_settings(str(other_tokenizer)))
    assert caught.value.param == "speculative.model"
    wider = tmp_path / "wider"  # the same model but for a larger vocabulary in its config
    shutil.copytree(tiny_model, wider)
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps(config | {"vocab_size": 5000}))
    with pytest.raises(InvalidParam, match="vocabulary") as caught:
        build_engine(tiny_model, speculative=draft_settings(str(wider)))
    assert caught.value.param == "speculative.model"
    with pytest.raises(InvalidParam) as caught:
        build_engine(tiny_model, speculative=draft_settings(str(tmp_path / "nothing")))
    assert caught.value.param == "speculative.model"
