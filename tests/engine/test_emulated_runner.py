"""`engine.device: emulated`: the real engine over the cost model on the wall clock, saying a
fixed text in the served tokenizer's ids."""

from __future__ import annotations

import time

import pytest

from engine.core.config import EmulateConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core.errors import InvalidParam
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runner.cost_model import GPUS, MODELS, kv_blocks_for
from engine.runner.emulated_runner import TEXT


def _engine(model: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="emulated", **kwargs))


def test_kv_capacity_is_the_emulated_gpus(tiny_model):
    engine = _engine(tiny_model, emulate=EmulateConfig(model="Llama-3.1-8B", gpu="H100-80GB"))
    assert engine.runner.num_kv_blocks() == kv_blocks_for(
        MODELS["Llama-3.1-8B"], GPUS["H100-80GB"], 16, 0.9
    )
    h200 = _engine(tiny_model, emulate=EmulateConfig(model="Llama-3.1-8B", gpu="H200"))
    assert h200.runner.num_kv_blocks() > engine.runner.num_kv_blocks()
    assert engine.runner.max_model_len() == 2048  # the served checkpoint's context


def test_bad_names_are_errors_naming_the_knob(tiny_model):
    with pytest.raises(InvalidParam) as bad:
        _engine(tiny_model, emulate=EmulateConfig(gpu="H100"))
    assert bad.value.param == "emulate.gpu" and "H100-80GB" in str(bad.value)
    with pytest.raises(InvalidParam) as bad:
        _engine(tiny_model, emulate=EmulateConfig(model="llama"))
    assert bad.value.param == "emulate.model"
    with pytest.raises(InvalidParam) as bad:
        _engine(tiny_model, scheduler=SchedulerConfig(preemption_mode="swap"))
    assert bad.value.param == "preemption_mode"


def test_it_says_the_text_and_stops_where_asked(tiny_model):
    engine = _engine(tiny_model)
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    first, again = engine.generate(["Hello", "Hello"], plain)
    assert first.token_ids == again.token_ids  # deterministic, whatever the batch
    said = engine.tokenizer.decode(first.token_ids)
    assert said == first.text and said.strip() in TEXT
    (stopped,) = engine.generate(["Hello"], SamplingParams(max_tokens=60, stop=["bridge"]))
    assert stopped.finish_reason == "stop" and stopped.text.endswith("old stone ")
    (asked,) = engine.generate(["Hello"], SamplingParams(max_tokens=2, logprobs=2))
    assert asked.token_ids == first.token_ids[:2]


def test_steps_take_the_time_the_cost_model_prices_them_at(tiny_model):
    """The run's wall time is at least what its steps are priced at (a step is not
    collected before it is due) and, the host's work overlapping the emulated device's, at
    most a quarter more: the tolerance the emulation is documented with."""
    engine = _engine(tiny_model, scheduler=SchedulerConfig(max_num_seqs=64))
    engine.generate(["warm"], SamplingParams(max_tokens=2, ignore_eos=True))
    before = engine.runner.busy_seconds
    started = time.monotonic()
    engine.generate(["Hello"] * 64, SamplingParams(max_tokens=48, ignore_eos=True))
    wall = time.monotonic() - started
    priced = engine.runner.busy_seconds - before
    assert priced > 0.2  # 48 steps of an 8B model on an H100: a few ms each
    assert priced <= wall <= 1.25 * priced + 0.05


def test_speculation_verifies_drafts_against_the_text(tiny_model):
    spec = SpeculativeConfig(enabled=True, num_speculative_tokens=4, adaptive=False)
    engine = _engine(tiny_model, speculative=spec)
    plain = _engine(tiny_model)
    prompt = engine.runner.text * 2  # prompt lookup finds the text it says next
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    (drafted,) = engine.generate([prompt], params)
    (reference,) = plain.generate([prompt], params)
    assert drafted.token_ids == reference.token_ids
    stats = engine.scheduler.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
