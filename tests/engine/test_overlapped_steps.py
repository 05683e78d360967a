"""engine.overlap_steps: while a step is in flight (computed only when collected, as on a
GPU), the previous step's tokens are detokenized and returned. Outputs equal the engine's
without overlap: greedy tokens, seeded draws, stop strings, aborts, grammars; no block leaks."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.core.fixed_proposers import ReplayProposer
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.llm_engine import LLMEngine
from tests.conftest import build_engine
from tests.engine.oracle import HFOracle
from tests.engine.test_async_engine import stream_all
from tests.engine.test_oracle import check_against_oracle, random_prompts, scenario_engine
from tests.engine.test_speculator import CountingProposer


class StepWatch:
    """Drives an engine step by step, counting the steps left in flight between calls."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.num_in_flight = 0
        self.tokens: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.finish: dict[str, str | None] = {}
        self.logprobs: dict[str, list] = {}

    def step(self) -> None:
        for out in self.engine.step():
            assert out.request_id not in self.finish, f"{out.request_id}: a delta after its end"
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            self.text[out.request_id] = self.text.get(out.request_id, "") + out.new_text
            self.logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
            if out.finished:
                self.finish[out.request_id] = out.finish_reason
        self.engine.scheduler.check_integrity()
        self.num_in_flight += bool(self.engine.core.in_flight)

    def run(self, requests: dict[str, tuple[list[int] | str, SamplingParams]]) -> StepWatch:
        for rid, (prompt, params) in requests.items():
            self.engine.add_request(rid, prompt, params)
        while self.engine.has_unfinished_requests():
            self.step()
        assert_all_free(self.engine)
        return self


def assert_all_free(engine: LLMEngine) -> None:
    kv = engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.outputs.tracked


# Steps in flight computed when collected, or at launch (tests/engine/deferred_runner.py).
computed_when = pytest.mark.parametrize("computed", [True, "at_launch"], ids=["collect", "launch"])


def greedy(n: int, **more) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **more)


@pytest.mark.parametrize("scenario", ["roomy", "chunked-prefill", "preemption", "static"])
def test_overlapped_greedy_tokens_match_hf_generate(tiny_model, scenario):
    engine = scenario_engine(tiny_model, scenario, deferred_steps=True)
    rng = random.Random(3)
    prompts = random_prompts(3, 12, max_len=50)
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    requests = {str(i): (p, greedy(max_tokens[i])) for i, p in enumerate(prompts)}
    watch = StepWatch(engine).run(requests)
    tokens = {int(rid): t for rid, t in watch.tokens.items()}
    check_against_oracle(HFOracle(tiny_model), prompts, max_tokens, tokens)
    assert watch.num_in_flight > 10, "steps were meant to stay in flight"
    assert engine.core.num_continuations > 5, "steps were meant to be launched ahead"
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions_total > 0


def test_without_overlap_no_step_stays_in_flight(tiny_model):
    engine = build_engine(tiny_model, deferred_steps=True, overlap_steps=False)
    watch = StepWatch(engine).run({"a": ("hello", greedy(8)), "b": ("there", greedy(5))})
    assert watch.num_in_flight == 0 and len(watch.tokens["a"]) == 8


def stop_string_requests(tiny_model) -> dict[str, tuple[str, SamplingParams]]:
    """Prompts with a stop string taken from the middle of their own greedy text."""
    plain = StepWatch(build_engine(tiny_model)).run(
        {f"s{i}": (f"story {i} begins", greedy(30)) for i in range(6)}
    )
    requests = {}
    for rid, text in plain.text.items():
        at = len(text) // 3
        requests[rid] = (f"story {rid[1:]} begins", greedy(30, stop=[text[at : at + 3]]))
    return requests


@computed_when
def test_a_stop_string_found_while_the_next_step_runs_ends_the_request_the_same(
    tiny_model, computed
):
    requests = stop_string_requests(tiny_model)
    sync = StepWatch(build_engine(tiny_model)).run(requests)
    overlapped = StepWatch(build_engine(tiny_model, deferred_steps=computed))
    overlapped.run(requests)
    assert overlapped.num_in_flight > 5
    assert set(sync.finish.values()) == {"stop"}
    assert overlapped.text == sync.text and overlapped.finish == sync.finish
    # The step in flight when the stop string showed computed one more token: dropped.
    assert overlapped.tokens == sync.tokens


@computed_when
def test_stop_tokens_and_min_tokens_end_requests_the_same_with_steps_launched_ahead(
    tiny_model, computed
):
    prompts = {f"t{i}": f"tokens {i} then" for i in range(6)}
    plain = StepWatch(build_engine(tiny_model)).run(
        {rid: (p, greedy(24)) for rid, p in prompts.items()}
    )
    requests = {}
    for i, (rid, prompt) in enumerate(prompts.items()):
        stop = plain.tokens[rid][3 + i]  # a token of its own greedy output
        params = SamplingParams(
            temperature=0.0, max_tokens=24, stop_token_ids=[stop], min_tokens=2 * i
        )
        requests[rid] = (prompt, params)
    sync = StepWatch(build_engine(tiny_model)).run(requests)
    engine = build_engine(tiny_model, deferred_steps=computed)
    overlapped = StepWatch(engine).run(requests)
    assert engine.core.num_continuations > 3
    assert "stop" in sync.finish.values()
    assert overlapped.tokens == sync.tokens and overlapped.finish == sync.finish


@computed_when
def test_a_request_aborted_while_its_step_is_in_flight_gets_nothing_more(tiny_model, computed):
    engine = build_engine(tiny_model, deferred_steps=computed)
    watch = StepWatch(engine)
    for rid in "abc":
        engine.add_request(rid, f"request {rid}", greedy(20))
    for _ in range(4):
        watch.step()
    in_flight = engine.core.in_flight
    assert in_flight
    assert "b" in {s.request_id for s in in_flight[-1].scheduled.scheduled}
    before = len(watch.tokens["b"])
    engine.abort("b")
    while engine.has_unfinished_requests():
        watch.step()
    assert len(watch.tokens["b"]) == before and "b" not in watch.finish
    assert len(watch.tokens["a"]) == len(watch.tokens["c"]) == 20
    assert_all_free(engine)
    alone = StepWatch(build_engine(tiny_model)).run({"a": ("request a", greedy(20))})
    assert watch.tokens["a"] == alone.tokens["a"]


@computed_when
def test_seeded_draws_penalties_and_logprobs_are_unchanged_by_overlap(tiny_model, computed):
    def requests() -> dict[str, tuple[str, SamplingParams]]:
        return {
            f"r{i}": (
                f"sampled {i}",
                SamplingParams(
                    temperature=1.0,
                    top_p=0.9,
                    seed=100 + i,
                    max_tokens=16,
                    ignore_eos=True,
                    frequency_penalty=0.5 if i % 2 else 0.0,
                    logprobs=2 if i % 3 == 0 else None,
                ),
            )
            for i in range(6)
        }

    sync = StepWatch(build_engine(tiny_model)).run(requests())
    engine = build_engine(tiny_model, deferred_steps=computed)
    overlapped = StepWatch(engine).run(requests())
    assert overlapped.num_in_flight > 5 and engine.core.num_continuations > 5
    assert overlapped.tokens == sync.tokens
    for rid, entries in sync.logprobs.items():
        got = overlapped.logprobs[rid]
        assert [e.top for e in got] == [e.top for e in entries]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in entries])


@computed_when
def test_penalties_count_the_token_of_the_step_still_in_flight(tiny_model, computed):
    """Greedy rows under strong penalties: steps launched ahead take the token of the step
    before (on the device only) into their counts, so every choice equals the plain loop's."""

    kinds = [
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 3.0},
        {"frequency_penalty": 1.0, "repetition_penalty": 2.0},
    ]

    def requests(penalized: bool = True) -> dict[str, tuple[str, SamplingParams]]:
        return {
            f"p{i}": (f"penalized {i}", greedy(24, **(kind if penalized else {})))
            for i, kind in enumerate(kinds)
        }

    sync = StepWatch(build_engine(tiny_model, overlap_steps=False)).run(requests())
    engine = build_engine(tiny_model, deferred_steps=computed)
    overlapped = StepWatch(engine).run(requests())
    assert engine.core.num_continuations > 10
    assert overlapped.tokens == sync.tokens
    # The penalties change the greedy tokens (else this would test nothing).
    plain = StepWatch(build_engine(tiny_model, overlap_steps=False)).run(requests(False))
    assert all(sync.tokens[rid] != plain.tokens[rid] for rid in plain.tokens)


def grammar_requests() -> dict[str, tuple[str, SamplingParams]]:
    """Regex rows ending by a stop token, by the grammar alone (ignore_eos), or by length."""

    def held(pattern: str, temperature: float = 0.0, **more) -> SamplingParams:
        spec = StructuredOutput("regex", pattern)
        return SamplingParams(temperature=temperature, max_tokens=24, structured=spec, **more)

    return {
        "plain": ("plain words", greedy(24)),
        "id": ("an id", held(r"[a-f]{3}-\d{2,4}")),
        "short": ("a word", held(r"(yes|no)")),
        # The scheduler goes on past a stop token here: the grammar ends the request.
        "whole": ("a word", held(r"(yes|no)", ignore_eos=True)),
        "sampled": ("a code", held(r"[A-Z]{2}\d{6}", temperature=1.0, seed=5)),
    }


@computed_when
def test_grammar_rows_stay_in_flight_and_take_each_step_when_it_is_collected(tiny_model, computed):
    """A step's tokens reach the grammar matchers when it is collected: the next step's masks
    see them, the previous step's outputs (read while it runs) do not. A grammar that ends
    its document ends the request while the next step is in flight (that row unmasked, its
    token dropped)."""
    sync = StepWatch(build_engine(tiny_model)).run(grammar_requests())
    engine = build_engine(tiny_model, deferred_steps=computed)
    overlapped = StepWatch(engine).run(grammar_requests())
    assert overlapped.tokens == sync.tokens and overlapped.text == sync.text
    assert overlapped.finish == sync.finish
    assert overlapped.finish["id"] == overlapped.finish["short"] == "stop"
    assert overlapped.finish["whole"] == "stop"
    assert overlapped.text["short"] in ("yes", "no") and overlapped.text["whole"] in ("yes", "no")
    # Every step but the last stayed in flight while the host read the one before.
    assert overlapped.num_in_flight >= engine.runner.num_launched - 2


def test_async_engine_streams_with_steps_in_flight(tiny_model):
    prompts = ["one", "two two", "three three three"]
    sync = StepWatch(build_engine(tiny_model)).run(
        {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts)}
    )

    async def main() -> dict[str, list[int]]:
        engine = AsyncLLMEngine(build_engine(tiny_model, deferred_steps=True))
        got = await stream_all(engine, prompts, greedy(12))
        assert_all_free(engine.engine)
        await engine.shutdown()
        return {f"r{i}": t for i, t in enumerate(got)}

    assert asyncio.run(main()) == sync.tokens


def test_a_speculator_that_drafts_nothing_leaves_steps_launched_ahead(tiny_model):
    """Where the adaptive rule finds no draft worth its step, steps are launched ahead as
    without speculation; where it drafts, the step after waits for the verified tokens."""
    requests = {f"r{i}": ("ab ab ab ab " * (i + 1), greedy(16)) for i in range(3)}
    sync = StepWatch(build_engine(tiny_model)).run(requests)
    quiet = build_engine(tiny_model, deferred_steps=True, speculative={"enabled": True})
    times = quiet.scheduler.speculator.times
    times.observe(1, 0.001, drafted=False)
    times.observe(4, 10.0, drafted=True)  # a drafted step would cost ten seconds
    assert StepWatch(quiet).run(requests).tokens == sync.tokens
    assert quiet.core.num_continuations > 5
    assert quiet.scheduler.stats().spec.num_draft_tokens == 0
    drafting = build_engine(
        tiny_model, deferred_steps=True, speculative={"enabled": True, "adaptive": False}
    )
    drafting.scheduler.speculator.proposer = ReplayProposer(sync.tokens, 0.6, vocab_size=100)
    assert StepWatch(drafting).run(requests).tokens == sync.tokens
    assert drafting.scheduler.stats().spec.num_draft_tokens > 0
    assert drafting.core.num_continuations == 0


def test_prompt_lookup_that_finds_nothing_leaves_most_steps_launched_ahead(tiny_model):
    """Speculation on with a proposer that finds no draft (prompt lookup on text that does
    not repeat): it is asked rarely, and the steps between are launched ahead as without
    speculation, with the same tokens."""
    prompts = random_prompts(seed=7, n=2, max_len=20)
    requests = {f"r{i}": (prompt, greedy(48)) for i, prompt in enumerate(prompts)}
    sync = StepWatch(build_engine(tiny_model)).run(requests)
    engine = build_engine(
        tiny_model, deferred_steps=True, speculative={"enabled": True, "adaptive": False}
    )
    proposer = engine.scheduler.speculator.proposer = CountingProposer({})
    assert StepWatch(engine).run(requests).tokens == sync.tokens
    assert len(proposer.asked_at) <= 8
    assert engine.core.num_continuations >= 30
