"""Admission and preemption order: fcfs, priority, sjf; aging; sparing just-resumed requests;
and SJF's effect on mean latency in the simulator."""

from __future__ import annotations

from engine.core.clock import VirtualClock
from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.sched.request_order import RESUME_GRACE_STEPS
from engine.core.sched.scheduler import Scheduler
from tests.engine.helpers import fake_run


def make(policy: str, num_blocks: int = 64, max_num_seqs: int = 1, aging_s: float = 30.0):
    clock = VirtualClock()
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        max_model_len=256,
        scheduling_policy=policy,
        aging_s=aging_s,
    )
    return Scheduler(config, KVCacheManager(num_blocks, 4, False), clock), clock


def req(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [11] * prompt_len, params, priority=priority)


def admission_order(sched: Scheduler, clock: VirtualClock, requests: list[Request]) -> list[str]:
    for r in requests:
        sched.add_request(r)
    order: list[str] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for s in out.scheduled:
            if s.request_id not in order:
                order.append(s.request_id)
        sched.update_from_output(out, fake_run(out))
        sched.check_integrity()
        clock.advance(0.01)
    return order


def mixed() -> list[Request]:
    return [
        req("a", 20, 10, priority=3),
        req("b", 4, 2, priority=1),
        req("c", 12, 30, priority=0),
        req("d", 8, 4, priority=2),
    ]


def test_each_policy_admits_in_its_order():
    for policy, expected in (
        ("fcfs", ["a", "b", "c", "d"]),
        ("priority", ["c", "b", "d", "a"]),  # priorities 3, 1, 0, 2
        ("sjf", ["b", "d", "a", "c"]),  # sizes 30, 6, 42, 12
    ):
        sched, clock = make(policy)
        sched.add_request(req("first", 4, 1))  # occupies the one slot while the rest queue
        assert admission_order(sched, clock, mixed()) == ["first", *expected], policy


def test_aging_bounds_the_wait_under_a_stream_of_better_requests():
    """A priority-9 request waits behind an endless stream of priority-0 ones until it has
    waited aging_s; then it goes first."""
    sched, clock = make("priority", aging_s=5.0)
    sched.add_request(req("busy", 4, 3))
    sched.add_request(req("patient", 4, 3, priority=9))
    started = None
    i = 0
    while started is None:
        sched.add_request(req(f"eager{i}", 4, 3, priority=0))  # a better one every step
        i += 1
        out = sched.schedule()
        if any(s.request_id == "patient" for s in out.scheduled):
            started = clock.now()
        sched.update_from_output(out, fake_run(out))
        clock.advance(0.5)
        assert clock.now() < 60, "the low-priority request starved"
    # Admitted once it had waited 5 s, as soon as the slot freed (one request: 3 steps).
    assert 5.0 <= started <= 5.0 + 3 * 0.5


def test_preemption_takes_the_worst_ranked_running_request():
    # 7 blocks of 4 tokens: two requests of 8-token prompts growing to 20 tokens cannot both
    # finish; the lower priority one goes, although it was admitted first.
    sched, clock = make("priority", num_blocks=7, max_num_seqs=2)
    sched.add_request(req("low", 8, 12, priority=5))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))
    sched.add_request(req("high", 8, 12, priority=0))
    preempted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted += out.preempted_request_ids
        sched.update_from_output(out, fake_run(out))
        sched.check_integrity()
    assert preempted and preempted[0] == "low"
    # Under fcfs the same case preempts the later arrival.
    sched, clock = make("fcfs", num_blocks=7, max_num_seqs=2)
    sched.add_request(req("low", 8, 12, priority=5))
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out))
    clock.advance(1.0)
    sched.add_request(req("high", 8, 12, priority=0))
    preempted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted += out.preempted_request_ids
        sched.update_from_output(out, fake_run(out))
    assert preempted and preempted[0] == "high"


def test_a_request_that_just_resumed_is_not_the_next_victim():
    sched, _ = make("priority", max_num_seqs=4)
    running = [req(name, 4, 4, priority=p) for name, p in (("a", 0), ("b", 1), ("c", 9))]
    for r in running:
        sched.add_request(r)
    sched.waiting.clear()
    sched.running = list(running)  # c ranks last: the natural victim
    sched.num_steps_total = 100
    running[2].resumed_at_step = 100 - RESUME_GRACE_STEPS + 1  # c just came back
    assert sched.pick_victim(0) is running[1]  # b goes instead
    running[2].resumed_at_step = 100 - RESUME_GRACE_STEPS  # grace over
    assert sched.pick_victim(0) is running[2]
    # Only just-resumed candidates left: the worst of them still goes (progress over grace).
    sched.running = [running[0], running[2]]
    running[2].resumed_at_step = 100
    assert sched.pick_victim(0) is running[2]


def test_sjf_lowers_mean_latency_in_the_simulator():
    from cluster.sim_config import SimConfig
    from cluster.simulator import Simulator
    from cluster.workload import LengthDist, make_workload
    from engine.runner.cost_model import GPUS, MODELS

    trace = make_workload(
        600,
        rate=14.0,
        prompt=LengthDist("lognormal", 300, 1.0, lo=4, hi=2048),
        output=LengthDist("lognormal", 300, 1.2, lo=4, hi=1500),
        seed=11,
    )
    means = {}
    for policy in ("fcfs", "sjf"):
        config = SimConfig(MODELS["Llama-2-7B"], GPUS["A100-40GB"]).with_scheduler(
            max_num_seqs=32, scheduling_policy=policy
        )
        records = Simulator(config).run(trace).records.values()
        means[policy] = sum(r.e2e for r in records) / len(records)
    assert means["sjf"] < 0.9 * means["fcfs"], means
