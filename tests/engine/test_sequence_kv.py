"""A sequence moved out of one engine with its KV (LLMEngine.move_out) goes on at another
(Resume with `kv`) exactly as an undisturbed run, without computing its context again: greedy
and seeded, moved mid-decode or mid-prefill, with prefix-cached blocks, FP8 KV, a LoRA
adapter, steps in flight; KV that cannot stand for the context is computed again instead;
every block comes back at both ends after success, abort and a failed write."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from engine.async_engine import AsyncLLMEngine
from engine.core.request import Resume
from engine.core.sampling_params import SamplingParams
from engine.core.sequence_kv import SequenceMoved
from tests.conftest import build_engine
from tests.lora_adapters import lora_adapters

PROMPT = [1203, 77, 2981, 400, 15, 3003, 9, 41, 5, 812, 1999, 64, 7, 300]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=1.0, top_p=0.9, seed=5, repetition_penalty=1.3, max_tokens=14, ignore_eos=True
)


def engine(model: str, **knobs):
    knobs = {"max_num_seqs": 4, "max_num_batched_tokens": 16, **knobs}
    return build_engine(model, 4, 120, **knobs)


def run(eng, request_id, params, prompt=PROMPT, resume=None, steps=None, lora=None):
    """Step `eng` with the request (until it ends, or `steps` steps): its deltas."""
    eng.add_prepared(eng.make_request(request_id, prompt, params, resume=resume, lora=lora))
    outs, n = [], 0
    while eng.has_unfinished_requests() and (steps is None or n < steps):
        outs += [o for o in eng.step() if o.request_id == request_id]
        n += 1
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text(outs) -> str:
    return "".join(o.new_text for o in outs)


def counting_tokens(eng) -> list[int]:
    """The token count of every step `eng` launches from now on."""
    counts: list[int] = []
    launch = eng.runner.launch

    def counted(scheduler_output):
        counts.append(scheduler_output.num_batched_tokens)
        return launch(scheduler_output)

    eng.runner.launch = counted
    return counts


def assert_no_block_held(eng) -> None:
    kv = eng.scheduler.kv_cache
    eng.scheduler.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def move(source, target, request_id, params, steps, prompt=PROMPT, lora=None):
    """Run the request `steps` steps at `source`, move it to `target` and finish it there:
    (deltas at the source, deltas at the target, the KV moved, tokens the target's steps
    computed)."""
    before = run(source, request_id, params, prompt, steps=steps, lora=lora)
    before += source.settle()
    kv = source.move_out([request_id])[request_id]
    assert_no_block_held(source)
    computed = counting_tokens(target)
    resume = Resume(tokens(before), len(text(before)), kv)
    after = run(target, request_id, params, prompt, resume=resume, lora=lora)
    assert_no_block_held(target)
    return before, after, kv, computed


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("steps", [2, 5])
def test_a_moved_sequence_goes_on_exactly_without_recomputing(tiny_model, params, steps):
    source, target = engine(tiny_model), engine(tiny_model)
    whole = run(source, "whole", params)
    before, after, kv, computed = move(source, target, "r", params, steps)
    assert kv is not None and kv.num_tokens == len(PROMPT) + len(tokens(before)) - 1
    assert tokens(before) + tokens(after) == tokens(whole)
    assert text(before) + text(after) == text(whole)
    assert after[-1].num_output_tokens == len(tokens(whole))
    # Its context came with it: every step at the target decodes its one token.
    assert computed == [1] * len(tokens(after))
    assert target.num_kv_refused == 0


def test_a_sequence_moved_mid_prefill_carries_the_chunks_computed(tiny_model):
    source = engine(tiny_model, max_num_batched_tokens=4, enable_prefix_caching=False)
    target = engine(tiny_model)
    whole = run(source, "whole", GREEDY)
    before, after, kv, computed = move(source, target, "r", GREEDY, steps=2)
    assert tokens(before) == [] and kv.num_tokens == 8  # two chunks of four
    assert tokens(after) == tokens(whole)
    assert computed[0] == len(PROMPT) - 8


def test_blocks_the_source_shares_through_its_prefix_cache_move_and_stay_cached(tiny_model):
    source, target = engine(tiny_model), engine(tiny_model)
    whole = run(source, "whole", GREEDY)  # leaves its full blocks in the prefix cache
    hits = source.scheduler.kv_cache.prefix_hits
    before, after, _, computed = move(source, target, "r", GREEDY, steps=1)
    assert source.scheduler.kv_cache.prefix_hits > hits
    assert tokens(before) + tokens(after) == tokens(whole)
    assert computed == [1] * len(tokens(after))
    again = run(source, "again", GREEDY)  # the shared blocks were not harmed
    assert tokens(again) == tokens(whole)


def test_steps_in_flight_are_settled_before_the_move(tiny_model):
    source = engine(tiny_model, deferred_steps=True)
    target = engine(tiny_model)
    whole = run(engine(tiny_model), "whole", GREEDY)
    before, after, _, computed = move(source, target, "r", GREEDY, steps=4)
    assert tokens(before) + tokens(after) == tokens(whole)
    assert computed == [1] * len(tokens(after))


def test_fp8_kv_moves_with_its_scales(tiny_model):
    fp8 = {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True}
    source = engine(tiny_model, **fp8)
    whole = run(source, "whole", GREEDY)  # measures the source's scales
    target = engine(tiny_model, **fp8)  # has measured none: takes the source's
    before, after, kv, computed = move(source, target, "r", GREEDY, steps=3)
    assert kv.cache_dtype == "float8_e4m3fn" and kv.scales is not None
    assert tokens(before) + tokens(after) == tokens(whole)
    assert computed == [1] * len(tokens(after))


def test_fp8_kv_moves_to_a_replica_with_other_scales_requantized(tiny_model):
    fp8 = {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True}
    source, target = engine(tiny_model, **fp8), engine(tiny_model, **fp8)
    run(target, "first", GREEDY, prompt=[9] * 30)  # measures other scales than the source's
    before, after, kv, computed = move(source, target, "r", GREEDY, steps=3)
    layer = target.runner.model.layers[0].self_attn
    assert kv.scales[0][0] != float(layer.kv_scales[0])
    # Its blocks re-quantized to the target's scales: it goes on without recomputing.
    assert len(tokens(before) + tokens(after)) == GREEDY.max_tokens
    assert computed == [1] * len(tokens(after))


def test_a_lora_sequence_moves_with_its_adapter(tiny_model):
    adapters = lora_adapters(tiny_model)
    name = next(iter(adapters))
    lora = {"adapters": adapters, "max_loras": 2}
    source, target = engine(tiny_model, lora=lora), engine(tiny_model, lora=lora)
    whole = run(source, "whole", GREEDY, lora=name)
    base = run(source, "base", GREEDY)
    assert tokens(whole) != tokens(base)
    before, after, _, computed = move(source, target, "r", GREEDY, steps=3, lora=name)
    assert tokens(before) + tokens(after) == tokens(whole)
    assert computed == [1] * len(tokens(after))


def test_kv_that_cannot_stand_for_the_context_is_computed_again(tiny_model):
    source = engine(tiny_model)
    whole = run(source, "whole", GREEDY)
    before = run(source, "r", GREEDY, steps=3)
    kv = source.move_out(["r"])["r"]
    done = tokens(before)
    for bad in (
        dataclasses.replace(kv, block_size=8),  # another cache layout
        dataclasses.replace(kv, token_ids=[7] + kv.token_ids[1:]),  # another sequence's
        dataclasses.replace(kv, data=kv.data[:, :1]),  # a layer's V missing
    ):
        target = engine(tiny_model)
        computed = counting_tokens(target)
        after = run(target, "r", GREEDY, resume=Resume(done, len(text(before)), bad))
        assert tokens(after) == tokens(whole)[len(done) :]
        # Its whole context computed here, then a token a step.
        assert sum(computed) == len(PROMPT) + len(done) + len(tokens(after)) - 1
        assert target.num_kv_refused == 1
        assert_no_block_held(target)


def test_blocks_come_back_when_an_imported_sequence_aborts_or_its_write_fails(tiny_model):
    source = engine(tiny_model)
    before = run(source, "r", GREEDY, steps=3)
    kv = source.move_out(["r"])["r"]
    resume = Resume(tokens(before), len(text(before)), kv)
    target = engine(tiny_model)
    run(target, "r", GREEDY, resume=resume, steps=2)
    assert target.scheduler.kv_cache.num_used_blocks > 0
    target.abort("r")
    assert_no_block_held(target)
    # Bytes that pass the checks but cannot be read: the step that writes them fails its
    # requests, and the engine goes on.
    unreadable = dataclasses.replace(kv, data=np.empty(kv.data.shape, dtype=object))
    outs = run(target, "r2", GREEDY, resume=Resume(tokens(before), 0, unreadable))
    assert outs[-1].finish_reason == "error"
    assert_no_block_held(target)
    assert len(tokens(run(target, "r3", GREEDY))) == GREEDY.max_tokens
    assert_no_block_held(target)


def test_the_async_engine_ends_moved_streams_after_their_last_delta(tiny_model):
    async def scenario():
        source = AsyncLLMEngine(engine(tiny_model))
        got: dict[str, list] = {"a": [], "b": []}
        moved: dict[str, SequenceMoved] = {}

        async def consume(request_id):
            try:
                async for out in source.generate(PROMPT, GREEDY, request_id):
                    got[request_id] += out.new_token_ids
            except SequenceMoved as exc:
                moved[request_id] = exc

        tasks = [asyncio.create_task(consume(r)) for r in got]
        while len(got["a"]) < 3 or len(got["b"]) < 3:
            await asyncio.sleep(0.005)
        assert await source.move_out(["a"]) == 1
        await asyncio.wait_for(tasks[0], 10)
        await asyncio.wait_for(tasks[1], 30)  # "b" goes on to its end here
        kv = moved["a"].kv
        assert "b" not in moved and len(got["b"]) == GREEDY.max_tokens
        assert kv.num_tokens == len(PROMPT) + len(got["a"]) - 1  # every token it sent
        assert await source.move_out() == 0  # nothing left to move
        await source.wait_idle()
        assert_no_block_held(source.engine)
        await source.shutdown()

    asyncio.run(scenario())


def test_a_sequence_swapped_to_the_host_moves_with_its_kv_from_there(tiny_model):
    """A request preempted by swap (its KV in the host pool) when its replica moves it out:
    the KV leaves from the host pool, and it goes on at the target without recomputing."""
    move_swapped(tiny_model, engine(tiny_model))


def move_swapped(model: str, target, **knobs) -> None:
    """Two requests at a source too small for both (`knobs`: more of its build), one
    swapped out to the host pool, moved out from there to `target`: checks it goes on as an
    undisturbed run without recomputing, and every block comes back at both ends."""
    reference = engine(model, **knobs)
    whole = run(reference, "whole", GREEDY)
    reference.close()
    tight = {"enable_prefix_caching": False, "preemption_mode": "swap", "num_host_blocks": 40}
    source = build_engine(model, 4, 12, max_num_seqs=4, max_num_batched_tokens=16, **tight, **knobs)
    try:
        for rid in ("a", "b"):  # each needs 7 of the 12 blocks by its end: one is swapped out
            source.add_prepared(source.make_request(rid, PROMPT, GREEDY))
        outs: dict[str, list] = {"a": [], "b": []}
        while not (swapped := source.scheduler.kv_cache.swapped_ids()):
            assert source.has_unfinished_requests(), "nothing was swapped out"
            for out in source.step():
                outs[out.request_id].append(out)
        before = outs[(rid := swapped.pop())]
        before += [o for o in source.settle() if o.request_id == rid]
        kv = source.move_out([rid])[rid]
        assert kv is not None and kv.num_tokens == len(PROMPT) + len(tokens(before)) - 1
        computed = counting_tokens(target)
        after = run(target, rid, GREEDY, resume=Resume(tokens(before), len(text(before)), kv))
        assert tokens(before) + tokens(after) == tokens(whole)
        assert computed == [1] * len(tokens(after))
        assert_no_block_held(target)
        source.abort([r for r in outs if r != rid])
        assert source.scheduler.kv_cache.num_free_host_blocks == 40
        assert_no_block_held(source)
    finally:
        source.close()
