"""engine.overlap_steps on a GPU (skipped without CUDA): steps stay in flight while the host
processes the previous step, graphs replaying or not, and nothing changes in the outputs."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from tests.conftest import build_engine
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import SCENARIOS, check_against_oracle, run_mix, scenario_engine
from tests.engine.test_overlapped_steps import StepWatch, grammar_requests, stop_string_requests
from tests.gpu.test_cuda_engine import mixed_requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_engine(model: str, scenario: str, overlap: bool, eager: bool):
    engine = scenario_engine(
        model,
        scenario,
        device="cuda",
        attention_backend="triton",
        overlap_steps=overlap,
        enforce_eager=eager,
    )
    assert (engine.runner.graphs is None) == eager
    return engine


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_overlap_on_and_off_give_the_same_greedy_tokens(tiny_model, scenario, eager):
    pytest.importorskip("triton")
    prompts, max_tokens, arrive_at = mixed_requests(0)
    runs = [
        run_mix(cuda_engine(tiny_model, scenario, overlap, eager), prompts, max_tokens, arrive_at)
        for overlap in (True, False)
    ]
    assert runs[0] == runs[1]
    check_against_oracle(HFOracle(tiny_model), prompts, max_tokens, runs[0])


def test_steps_stay_in_flight_and_stop_strings_end_requests_the_same(tiny_model):
    requests = stop_string_requests(tiny_model)
    sync = StepWatch(build_engine(tiny_model, device="cuda", overlap_steps=False)).run(requests)
    engine = build_engine(tiny_model, device="cuda")
    overlapped = StepWatch(engine).run(requests)
    assert sync.num_in_flight == 0 and overlapped.num_in_flight > 5
    assert engine.core.num_continuations > 5  # launched before the step before was collected
    assert overlapped.text == sync.text and overlapped.tokens == sync.tokens


def test_seeded_sampling_is_the_same_with_steps_in_flight(tiny_model):
    def requests():
        return {
            f"r{i}": (
                f"draw {i}",
                SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=20),
            )
            for i in range(8)
        }

    sync = StepWatch(build_engine(tiny_model, device="cuda", overlap_steps=False)).run(requests())
    overlapped = StepWatch(build_engine(tiny_model, device="cuda")).run(requests())
    assert overlapped.tokens == sync.tokens


def test_penalties_and_logprobs_are_the_same_with_steps_launched_ahead(tiny_model):
    """Penalized rows count the token of the step in flight on the device; logprobs come to
    the host behind the kernels: neither stops steps being launched ahead."""

    def requests():
        return {
            f"r{i}": (
                f"penalized {i}",
                SamplingParams(
                    temperature=0.0,
                    max_tokens=24,
                    ignore_eos=True,
                    frequency_penalty=2.0 if i % 2 else 0.0,
                    repetition_penalty=2.0 if i % 3 == 0 else 1.0,
                    logprobs=2 if i < 3 else None,
                ),
            )
            for i in range(6)
        }

    sync = StepWatch(build_engine(tiny_model, device="cuda", overlap_steps=False)).run(requests())
    engine = build_engine(tiny_model, device="cuda")
    overlapped = StepWatch(engine).run(requests())
    assert engine.core.num_continuations > 10
    assert overlapped.tokens == sync.tokens
    for rid, entries in sync.logprobs.items():
        got = overlapped.logprobs[rid]
        assert [e.top for e in got] == [e.top for e in entries]


def test_grammar_rows_stay_in_flight_with_the_same_outputs(tiny_model):
    """Masks uploaded through pinned memory, matchers fed when a step is collected."""
    sync = StepWatch(build_engine(tiny_model, device="cuda", overlap_steps=False))
    sync.run(grammar_requests())
    overlapped = StepWatch(build_engine(tiny_model, device="cuda")).run(grammar_requests())
    assert overlapped.num_in_flight > 5
    assert overlapped.tokens == sync.tokens and overlapped.finish == sync.finish
