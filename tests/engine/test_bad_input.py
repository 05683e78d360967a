"""Bad input raises ValueError naming the field, and the engine keeps serving everyone else."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from tests.conftest import build_engine


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return build_engine(tiny_model, num_blocks=200, max_model_len=128)


BAD_REQUESTS = [
    ("", {}, "prompt"),
    ([], {}, "prompt"),
    ([1, 2, 99999], {}, "prompt"),
    ("hi", {"max_tokens": 0}, "max_tokens"),
    ("hi", {"max_tokens": 200}, "max_model_len"),
    ("hi", {"temperature": -0.5}, "temperature"),
    ("hi", {"top_p": 0.0}, "top_p"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("hi", {"stop": [""]}, "stop"),
]


@pytest.mark.parametrize(("prompt", "fields", "name"), BAD_REQUESTS)
def test_bad_request_names_the_field_and_others_are_served(engine, prompt, fields, name):
    good = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("good-before", "Hello", good)
    with pytest.raises(ValueError, match=name):
        params = SamplingParams(**fields) if fields else SamplingParams()
        engine.add_request("bad", prompt, params)
    engine.add_request("good-after", "World", good)
    produced: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
    assert produced == {"good-before": 6, "good-after": 6}
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_blocks


def test_unknown_model_directory_names_model(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nowhere")))


def test_unsupported_architecture_names_model(tiny_model, tmp_path):
    copy = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model: unsupported architecture"):
        LLMEngine(EngineConfig(model=str(copy)))


def test_max_model_len_beyond_the_model_is_refused(tiny_model):
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(EngineConfig(model=tiny_model, scheduler=SchedulerConfig(max_model_len=10**6)))


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (lambda: SchedulerConfig(batching="dynamic"), "batching"),
    ],
)
def test_bad_engine_config_names_the_field(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_a_failing_step_fails_only_its_requests_and_the_engine_goes_on(tiny_model):
    engine = build_engine(tiny_model, num_blocks=100)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("doomed", "hello there", greedy)
    engine.step()
    real_launch = engine.runner.launch

    def fault_once(scheduler_output):  # a fault injected into one step (e.g. a device error)
        engine.runner.launch = real_launch
        raise RuntimeError("injected device fault")

    engine.runner.launch = fault_once
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("doomed", "error")]
    assert "injected device fault" in outs[0].error
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_blocks
    after = engine.generate(["still serving"], greedy)[0]
    assert len(after.token_ids) == 5 and after.finish_reason == "length"
