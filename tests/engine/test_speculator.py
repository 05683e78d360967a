"""The scheduler's side of speculation, pure Python: prompt lookup, the adaptive rule that
prices drafts by measured step times and acceptance, the lookahead slots and their return,
and the counters /metrics reads."""

from __future__ import annotations

from engine.core.config import SchedulerConfig, SpeculativeConfig
from engine.core.draft_ledger import FIRST_COOLDOWN, JUDGE_AFTER, DraftLedger
from engine.core.fixed_proposers import ReplayProposer
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.ngram_proposer import NgramProposer
from engine.core.outputs import ModelRunnerOutput
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.sched.scheduler import Scheduler
from engine.core.speculator import DRY_HOLD_MAX, Speculator
from engine.core.step_time_model import StepTimeModel, StepTimes


def request(tokens: list[int], rid: str = "r", max_tokens: int = 50) -> Request:
    r = Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    r.num_output_tokens = 1  # decoding
    return r


def test_ngram_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    proposer = NgramProposer(min_n=1, max_n=3)
    # "5 6 7" occurred twice before; the latest is followed by 9 9.
    r = request([5, 6, 7, 8, 1, 5, 6, 7, 9, 9, 2, 5, 6, 7])
    assert proposer.propose_one(r, 2) == [9, 9]
    assert proposer.propose_one(r, 5) == [9, 9, 2, 5, 6]
    r.all_token_ids.append(4)  # "7 4" never occurred; "4" neither
    assert proposer.propose_one(r, 3) == []
    r.all_token_ids += [1]  # "1" occurred after 8 -> 5 6 7
    assert proposer.propose_one(r, 3) == [5, 6, 7]
    assert NgramProposer(2, 2).propose_one(request([1, 2]), 3) == []


def test_ngram_index_keeps_up_incrementally_as_a_full_scan_would():
    proposer = NgramProposer(min_n=2, max_n=4)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8]
    r = request(tokens[:3])
    for t in tokens[3:]:
        r.all_token_ids.append(t)
        got = proposer.propose_one(r, 3)
        fresh = NgramProposer(2, 4).propose_one(request(list(r.all_token_ids)), 3)
        assert got == fresh


def test_step_time_model_reads_between_and_beyond_measured_step_sizes():
    model = StepTimeModel()
    model.observe(8, 0.030)
    assert model.num_bands == 1 and model.seconds(100) == 0.030  # one size: flat
    for n, t in ((16, 0.034), (64, 0.090), (8, 0.030)):
        model.observe(n, t)
    assert model.num_bands == 3
    assert model.seconds(4) == 0.030  # below the smallest: as the smallest
    assert abs(model.seconds(12) - 0.032) < 1e-12  # between: interpolated
    assert abs(model.seconds(128) - (0.090 + 64 * (0.056 / 48))) < 1e-12  # the last slope


def _speculator(
    plain: dict[int, float], drafted: dict[int, float], rates: dict[str, float]
) -> Speculator:
    spec = Speculator(SpeculativeConfig(enabled=True, num_speculative_tokens=4))
    for points, kind in ((plain, False), (drafted, True)):
        for n, seconds in points.items():
            spec.observe_step(n, seconds, 1 if kind else 0)
    for rid, p in rates.items():  # twenty verifications of four drafts at that acceptance
        for _ in range(20):
            spec.verified(rid, 4, 4 if p == 1.0 else round(p / (1 - p)))
    return spec


def _batch(n: int, acceptance: float, spec: Speculator) -> list[tuple[Request, int]]:
    """`n` decoding requests that may draft four tokens each, each with twenty verifications
    at `acceptance` (one accepted of every four drafts: 0.25; all: 1.0)."""
    batch = [(request([1], str(i)), 4) for i in range(n)]
    for r, _ in batch:
        for _ in range(20):
            spec.verified(r.request_id, 4, round(4 * acceptance))
    return batch


def test_drafted_steps_are_read_as_their_excess_over_the_plain_step():
    times = StepTimes()
    times.observe(32, 0.047, drafted=False)
    times.observe(33, 0.062, drafted=True)  # the switch costs 15 ms
    assert times.ready
    assert abs(times.drafted_seconds(64) - 0.062) < 1e-12  # one of each: flat
    times.observe(64, 0.080, drafted=False)
    # The 15 ms carried along the plain curve.
    assert abs(times.drafted_seconds(64) - 0.095) < 1e-12
    times.observe(128, 0.200, drafted=True)  # 200 ms over a plain 128 read as 146 ms
    excess_128 = 0.200 - times.plain_seconds(128)
    assert abs(times.drafted_seconds(128) - 0.200) < 1e-12
    middle = times.drafted_seconds(80) - times.plain_seconds(80)
    assert 0.015 < middle < excess_128  # excesses interpolated between their sizes
    # The host slows down: plain steps take 30% longer; drafted ones keep their excess.
    for _ in range(20):
        times.observe(32, 0.047 * 1.3, drafted=False)
    assert times.drafted_seconds(33) - times.plain_seconds(33) > 0.014


def test_adaptive_rule_drafts_where_steps_are_weight_bound_and_stops_where_compute_is():
    # Five tokens cost hardly more than one: all four drafts pay at batch 1.
    spec = _speculator({1: 0.020}, {2: 0.0202, 5: 0.0204, 64: 0.030}, {"a": 0.8})
    assert spec._plan(1, [(request([1], "a"), 4)]) == {"a": 4}
    # Compute-bound from 16 tokens on: at batch 64 a draft costs more than it brings.
    spec = _speculator({16: 0.030, 64: 0.090}, {65: 0.092, 128: 0.170}, {})
    assert spec._plan(64, _batch(64, 0.25, spec)) == {}


def test_a_first_draft_pays_for_the_steps_switch_to_verification():
    # Batch 32: plain steps 47 ms; one drafted row takes the step to 62 ms, all 32 to 88.
    spec = _speculator({16: 0.040, 32: 0.047}, {33: 0.062, 64: 0.088}, {})
    batch = _batch(32, 0.5, spec)
    assert spec._plan(32, batch) == {}  # 0.5 a row: 48 tokens in 88 ms < 32 in 47
    spec = _speculator({16: 0.040, 32: 0.047}, {33: 0.062, 64: 0.088}, {})
    plan = spec._plan(32, _batch(32, 1.0, spec))
    assert sum(plan.values()) >= 32  # every row drafts: 64 tokens in 88 ms > 32 in 47
    # Where a few more tokens cost hardly anything, only the switch's cost stops a draft.
    flat = {16: 0.040, 32: 0.047, 40: 0.048, 64: 0.088}
    spec = _speculator(flat, {33: 0.062}, {})
    assert spec._plan(32, _batch(32, 0.5, spec)) == {}
    spec = _speculator(flat, {33: 0.047}, {})
    assert spec._plan(32, _batch(32, 0.5, spec))


def test_steps_priced_by_whole_tiles_fill_the_last_tile_with_drafts():
    # The CPU's GEMM streams the weights once per 16 tokens: 17 tokens cost as 32 do.
    model = StepTimeModel(tile=16)
    for n, seconds in ((16, 0.027), (17, 0.042), (32, 0.042), (48, 0.058)):
        model.observe(n, seconds)
    assert model.seconds(16) == 0.027 and model.seconds(20) == model.seconds(32) == 0.042
    spec = Speculator(SpeculativeConfig(enabled=True), token_tile=16)
    for n, seconds in ((16, 0.027), (32, 0.042), (48, 0.058)):
        spec.observe_step(n, seconds, 0)
    spec.observe_step(32, 0.0425, 15)
    # 17 rows: the 15 drafts that fill the second tile are nearly free, the next tile's not.
    assert sum(spec._plan(17, _batch(17, 0.5, spec)).values()) == 15


def test_adaptive_rule_gives_more_drafts_to_requests_that_accept_more():
    spec = _speculator({2: 0.020}, {3: 0.021, 8: 0.024, 32: 0.060}, {"good": 1.0, "poor": 0.25})
    batch = [(request([1], "good"), 4), (request([1], "poor"), 4)]
    plan = spec._plan(2, batch)
    assert plan.get("good", 0) > plan.get("poor", 0)


def test_a_replica_whose_drafts_failed_tries_new_requests_again_after_a_while():
    spec = _speculator({1: 0.020}, {2: 0.024, 5: 0.026}, {})  # a draft costs a fifth
    spec.proposer = ReplayProposer({"new": [7] * 40}, acceptance=1.0, vocab_size=100)
    for i in range(40):
        spec.verified(f"old{i}", 4, 0)
    fresh = request([1, 2, 3], "new")
    fresh.num_computed_tokens = 2  # decoding: its last token to compute
    assert spec.acceptance("new") < 0.05
    spec.begin_step([fresh])
    assert spec.drafts(fresh, 10) == []  # not worth a draft
    for _ in range(500):  # steps without drafts
        spec.begin_step([])
    assert spec.acceptance("new") > 0.3
    spec._num_steps = 1  # not a step that measures a plain step
    spec.begin_step([fresh])
    assert spec.drafts(fresh, 10)[:1] == [7]


def test_a_request_whose_first_draft_failed_is_tried_again_after_a_while():
    """One rejected probe must not write a request off for its whole life: its record fades
    while it drafts nothing, as the replica's does, until a draft is worth trying again."""
    spec = _speculator({1: 0.020}, {2: 0.028, 5: 0.030}, {})  # pays from about 0.4 accepted
    spec.proposer = ReplayProposer({"r": [7] * 400}, acceptance=1.0, vocab_size=100)
    decoding = request([1, 2, 3])
    decoding.num_computed_tokens = 2
    spec.verified("r", 1, 0)
    assert spec.acceptance("r") < 0.25
    drafted_at = None
    for step in range(400):
        spec.begin_step([decoding])
        if spec.drafts(decoding, 10):
            drafted_at = step
            break
    assert drafted_at is not None and drafted_at > 50


class CountingProposer(ReplayProposer):
    """Replays known tokens, answering as prompt lookup does when they run out."""

    dry_means_none_soon = True

    def __init__(self, outputs: dict[str, list[int]]) -> None:
        super().__init__(outputs, acceptance=1.0, vocab_size=100)
        self.asked_at: list[int] = []
        self.step = 0

    def propose(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        self.asked_at.append(self.step)
        return super().propose(wanted)


def test_a_proposer_that_found_nothing_rests_longer_each_time_and_drafts_once_it_finds():
    """Prompt lookup on text that does not repeat finds nothing: asking it costs the GPU its
    step launched ahead, so after each dry proposal it rests 1, 2, 4, ... steps (at most
    DRY_HOLD_MAX); once it finds drafts they are used and it is asked every step again."""
    spec = Speculator(SpeculativeConfig(enabled=True, adaptive=False))
    spec.proposer = proposer = CountingProposer({})
    decoding = request([1, 2, 3])
    decoding.num_computed_tokens = 2
    for step in range(80):
        proposer.step = step
        spec.begin_step([decoding])
        assert spec.drafts(decoding, 10) == []
    gaps = [b - a for a, b in zip(proposer.asked_at, proposer.asked_at[1:], strict=False)]
    assert gaps[:5] == [2, 3, 5, 9, 17] and set(gaps[5:]) == {DRY_HOLD_MAX + 1}
    proposer.outputs["r"] = [7] * 50
    for step in range(80, 80 + DRY_HOLD_MAX + 1):
        proposer.step = step
        spec.begin_step([decoding])
    assert spec.drafts(decoding, 10) == [7, 7, 7, 7]
    asked = len(proposer.asked_at)
    spec.begin_step([decoding])
    assert len(proposer.asked_at) == asked + 1 and spec.drafts(decoding, 10)
    # A rest is also served by steps launched ahead (which do not ask the proposer).
    proposer.outputs.clear()
    spec.begin_step([decoding])
    assert spec.continues() and not spec.continues()


def test_a_request_joining_a_resting_proposer_is_read_at_once():
    """The rest after dry answers was earned by the text of the requests asked: a request the
    proposer has not read yet is asked about in the step it first decodes, and the backoff
    starts again from one step (a repetitive prompt arriving after many plain ones drafts)."""
    spec = Speculator(SpeculativeConfig(enabled=True, adaptive=False))
    spec.proposer = proposer = CountingProposer({})
    old = request([1, 2, 3], "old")
    old.num_computed_tokens = 2
    for step in range(60):
        proposer.step = step
        spec.begin_step([old])
    assert spec._hold > 0  # resting
    new = request([4, 5, 6], "new")
    new.num_computed_tokens = 2
    proposer.step = 60
    spec.begin_step([old, new])
    assert proposer.asked_at[-1] == 60
    proposer.step = 61
    spec.begin_step([old, new])
    assert proposer.asked_at[-1] == 60  # dry again: one step's rest, the backoff's first
    proposer.step = 62
    spec.begin_step([old, new])
    assert proposer.asked_at[-1] == 62
    spec.forget("new")  # ended: a request of that id later is new again
    for step in range(63, 100):
        proposer.step = step
        spec.begin_step([old])
    proposer.step = 100
    spec.begin_step([old, new])
    assert proposer.asked_at[-1] == 100


def test_lookahead_slots_of_rejected_drafts_go_back_and_are_never_cached():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    speculator = Speculator(SpeculativeConfig(enabled=True, adaptive=False))
    scheduler = Scheduler(config, kv, speculator=speculator)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # with the output 4: drafts 5 6 7 8
    scheduler.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=30)))
    out = scheduler.schedule()  # the prompt
    scheduler.update_from_output(out, ModelRunnerOutput({"r": 4}))
    out = scheduler.schedule()
    (row,) = out.scheduled
    assert row.token_ids == [4, 5, 6, 7, 8] and row.num_drafts == 4
    assert len(row.block_ids) == 5  # 13 tokens + 4 drafts = 17 slots
    # The target agreed on the first draft only: 5, then drew 9 instead of 6.
    verdict = ModelRunnerOutput({}, spec_token_ids={"r": [5, 9]})
    (emitted,) = scheduler.update_from_output(out, verdict)
    assert emitted.new_token_ids == [5, 9]
    r = scheduler.requests["r"]
    assert r.all_token_ids == prompt + [4, 5, 9] and r.num_computed_tokens == 14
    assert len(kv.block_ids("r")) == 4  # 15 tokens need 4 blocks: the fifth went back
    scheduler.check_integrity()
    cached = [b.block_hash for b in kv.pool.blocks if b.block_hash is not None]
    assert len(cached) == 3  # the full blocks of computed tokens, none past them
    stats = scheduler.stats().spec
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 1)
    assert stats.accepted_per_position == [1, 0, 0, 0]
    scheduler.abort_requests(["r"])
    assert kv.num_free_blocks == 20 and r.status == RequestStatus.FINISHED_ABORTED


def test_drafts_stop_at_max_tokens_and_when_the_budget_is_short():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3, max_model_len=100)
    speculator = Speculator(SpeculativeConfig(enabled=True, adaptive=False))
    scheduler = Scheduler(config, kv, speculator=speculator)
    prompt = [7, 8, 9, 7, 8, 9, 7]
    scheduler.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=30)))
    for _ in range(2):  # the prompt in chunks of 3, but its last token
        scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput({}))
    out = scheduler.schedule()
    (row,) = out.scheduled
    assert row.token_ids == [7, 8, 9] and row.num_drafts == 2  # the budget holds 2 drafts
    scheduler.update_from_output(out, ModelRunnerOutput({}, spec_token_ids={"r": [8, 9, 4]}))
    r = scheduler.requests["r"]
    assert r.num_output_tokens == 3 and r.first_token_time is not None  # its first tokens
    short = Request("s", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    short.num_output_tokens = 1
    short.num_computed_tokens = short.num_tokens - 1
    speculator.begin_step([short])
    assert speculator.drafts(short, 10) == []  # one token left: nothing to draft


def test_the_ledger_stops_drafting_where_drafted_steps_lost_and_tries_again_later():
    ledger = DraftLedger()
    # Batch 128: plain steps of 128 rows take 100 ms; drafted ones made 150 tokens in 130 ms.
    for step in (1, 2):
        ledger.record(128, 150, 0.130, 0.100, step)
        assert ledger.allows(128, step + 1)  # no verdict before JUDGE_AFTER steps
    ledger.record(128, 150, 0.130, 0.100, 3)
    assert not ledger.allows(128, 4) and not ledger.allows(120, 4)  # the band, not the size
    assert ledger.allows(64, 4) and ledger.allows(1, 4)  # other batch sizes draft on
    assert ledger.allows(128, 3 + FIRST_COOLDOWN)
    for step in range(67, 67 + JUDGE_AFTER):  # it lost again: twice as long off
        ledger.record(128, 150, 0.130, 0.100, step)
    assert not ledger.allows(128, 69 + 2 * FIRST_COOLDOWN - 1)
    assert ledger.allows(128, 69 + 2 * FIRST_COOLDOWN)
    # Batch 1: two tokens a step in about a plain step's time pay, and go on paying.
    for step in range(1, 20):
        ledger.record(1, 3, 0.011, 0.010, step)
    assert ledger.allows(1, 20) and ledger.score(1) > 2
    # A draft that only breaks even is not worth it.
    for step in range(1, 1 + JUDGE_AFTER):
        ledger.record(32, 33, 0.0102, 0.010, step)
    assert not ledger.allows(32, JUDGE_AFTER + 1)


def test_a_host_where_drafted_steps_cost_more_than_modelled_stops_drafting_there():
    """The step-time model believes drafts are cheap (one cheap drafted step measured); the
    drafted steps this host really runs are slow: drafting stops there within JUDGE_AFTER
    drafted steps (the model learns from them, the ledger judges them) and stays off."""
    spec = _speculator({128: 0.100}, {129: 0.101}, {})
    batch = [request([1, 2, 3], str(i)) for i in range(128)]
    for r in batch:
        r.num_computed_tokens = 2
    outputs = {str(i): [7] * 100 for i in range(128)}
    spec.proposer = ReplayProposer(outputs, acceptance=1.0, vocab_size=100)
    drafted_steps = 0
    for _ in range(40):
        spec.begin_step(batch)
        drafts = sum(len(spec.drafts(r, 10)) for r in batch)
        if not drafts:
            spec.observe_step(128, 0.100, 0)
            continue
        drafted_steps += 1
        for r in batch:  # every draft counts, but the step took twice a plain one
            n = len(spec.drafts(r, 10))
            if n:
                spec.verified(r.request_id, n, n)
        spec.observe_step(128 + drafts, 0.100 * (1 + drafts / 128) * 1.6, drafts)
    assert 1 <= drafted_steps <= JUDGE_AFTER


def test_drafted_steps_grow_a_quarter_octave_past_the_largest_measured():
    # Plain steps flat to 128 tokens; one drafted step measured, of 33 tokens, nearly free:
    # the model would draft every row of a batch of 128, but may go only a quarter beyond.
    spec = _speculator({32: 0.047, 128: 0.050}, {33: 0.047}, {})
    plan = spec._plan(128, _batch(128, 1.0, spec))
    assert 0 < sum(plan.values()) <= 160 - 128
    spec.observe_step(160, 0.051, 32)  # measured there: the next step may go further
    assert sum(spec._plan(128, _batch(128, 1.0, spec)).values()) <= 200 - 128


def test_a_batch_size_new_to_plain_steps_is_measured_before_it_drafts():
    # Weight-bound: drafted steps up to 128 tokens cost hardly more than a plain one.
    spec = _speculator({1: 0.020}, {2: 0.0201, 128: 0.0215}, {})
    spec.proposer = ReplayProposer({str(i): [7] * 40 for i in range(64)}, 1.0, 100)
    batch = [r for r, _ in _batch(64, 1.0, spec)]
    for r in batch:
        r.num_computed_tokens = r.num_tokens - 1  # decoding: its last token to compute
    spec._num_steps = 1
    spec.begin_step(batch)
    assert not any(spec.drafts(r, 10) for r in batch)  # 64 rows: no plain step there yet
    spec.observe_step(64, 0.021, 0)
    spec.begin_step(batch)
    assert any(spec.drafts(r, 10) for r in batch)
