"""The simulator drives the real scheduler: deterministic, leak-free, same decisions as torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.sim_config import SimConfig
from cluster.simulator import Simulator, capacity
from cluster.workload import LengthDist, make_workload
from engine.core.clock import VirtualClock
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.outputs import SchedulerOutput
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runner.cost_model import GPUS, MODELS, CostModelRunner, ModelSpec, step_cost
from engine.runner.recording import RecordingRunner


def small_config(num_blocks: int | None = None, max_num_seqs: int = 64, **kw) -> SimConfig:
    base = SimConfig(model=MODELS["Llama-2-7B"], gpu=GPUS["A100-80GB"], **kw)
    return base.with_scheduler(max_num_seqs=max_num_seqs).with_cache(num_blocks=num_blocks)


def trace(n=200, rate=8.0, seed=1):
    return make_workload(n, rate, "poisson", seed=seed)


def test_same_seed_same_result_and_every_block_back():
    a = Simulator(small_config()).run(trace())
    b = Simulator(small_config()).run(trace())
    assert a.summary() == b.summary()
    assert a.summary()["finished"] == 200
    assert a.free_blocks_at_end == a.num_kv_blocks
    assert all(r.num_output == r.output_len for r in a.records.values())


def test_small_cache_preempts_and_still_finishes_everything():
    res = Simulator(small_config(num_blocks=300, max_num_seqs=128)).run(trace(150, 20.0))
    s = res.summary()
    assert s["finished"] == 150 and s["preemptions"] > 0
    assert res.free_blocks_at_end == 300


@pytest.mark.parametrize("policy", ["memory_aware", "sla", "combined"])
def test_dynamic_policies_finish_everything(policy):
    res = Simulator(small_config(policy=policy, num_blocks=400)).run(trace(150, 20.0))
    assert res.summary()["finished"] == 150
    assert res.free_blocks_at_end == 400


def test_cost_model_orders_of_magnitude():
    """Decode of one sequence on an A100-80GB is bound by streaming 13.5 GB of weights."""
    model = MODELS["Llama-2-7B"]
    assert 6.6e9 < model.num_params < 6.8e9
    runner = CostModelRunner(model, GPUS["A100-80GB"], VirtualClock())
    from engine.core.outputs import ScheduledRequest

    one = SchedulerOutput(
        [ScheduledRequest("a", [0], 100, [0], True, SamplingParams(), 1)], num_batched_tokens=1
    )
    t = step_cost(one, model, runner.gpu, runner.params).seconds
    assert 0.008 < t < 0.03, t
    big = SchedulerOutput(
        [ScheduledRequest("a", [0] * 2048, 0, [0], True, SamplingParams(), 0)],
        num_batched_tokens=2048,
    )
    assert step_cost(big, model, runner.gpu, runner.params).seconds > 5 * t  # compute-bound


def test_capacity_bisection_is_monotone_in_slo():
    def make(rate: float):
        return make_workload(
            80, rate, "poisson", LengthDist("fixed", 200), LengthDist("fixed", 100)
        )

    cfg = small_config()
    loose = capacity(replace(cfg, slo=replace(cfg.slo, ttft_s=5.0)), make, iters=5)
    tight = capacity(replace(cfg, slo=replace(cfg.slo, ttft_s=0.2)), make, iters=5)
    assert loose >= tight > 0


def test_offline_trace_same_decisions_under_cost_model_and_torch(tiny_model):
    """Every request present at t=0 with ignore_eos: scheduling depends only on lengths, so the
    cost model and the real torch runner must see the same sequence of steps."""
    from engine.runner.torch_runner import TorchModelRunner

    config = EngineConfig(
        model=tiny_model,
        # Small: forces preemptions. No prefix caching: hits after a preemption depend on the
        # sampled tokens, which differ between the two runners.
        cache=CacheConfig(block_size=4, num_blocks=60, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48, max_model_len=256),
    )
    items = make_workload(
        14,
        arrival="offline",
        prompt=LengthDist("uniform", 5, 60),
        output=LengthDist("uniform", 3, 30),
        seed=3,
    )

    def run(runner) -> tuple[list, int]:
        recorder = RecordingRunner(runner)
        clock = VirtualClock()
        engine = LLMEngine(config, runner=recorder, clock=clock)
        for it in items:
            params = SamplingParams(temperature=0.0, max_tokens=it.output_len, ignore_eos=True)
            engine.add_request(it.request_id, [5] * it.prompt_len, params)
        while engine.has_unfinished_requests():
            engine.step()
        decisions = [
            [(s.request_id, s.num_computed_tokens, s.num_tokens) for s in out.scheduled]
            for out in recorder.outputs
        ]
        return decisions, engine.stats().num_preemptions_total

    torch_runner = TorchModelRunner(config)
    spec = ModelSpec.from_hf_config(tiny_model)
    cost_runner = CostModelRunner(
        spec,
        GPUS["A100-80GB"],
        VirtualClock(),
        cache=CacheConfig(block_size=4, num_blocks=torch_runner.num_kv_blocks()),
        max_model_len=torch_runner.max_model_len(),
    )
    real, real_preempt = run(torch_runner)
    simulated, sim_preempt = run(cost_runner)
    assert real_preempt > 0  # the case is not trivial
    assert simulated == real
    assert sim_preempt == real_preempt


def test_the_simulator_reads_the_engines_tensor_parallel_size():
    """A 70B model does not fit one A100-80GB; with deploy.yaml's tensor_parallel_size: 4 the
    simulated replica spans four, as the engine would."""
    model, gpu = MODELS["Llama-3-70B"], GPUS["A100-80GB"]
    engine = EngineConfig(model="unused", tensor_parallel_size=4)
    config = SimConfig.for_engine(engine, model, gpu)
    assert config.model.tp == 4 and config.scheduler == replace(
        engine.scheduler, max_model_len=4096
    )
    result = Simulator(config).run(trace(40, 4.0))
    assert result.summary()["finished"] == 40 and result.num_kv_blocks > 0
    with pytest.raises(ValueError, match="70B@tp1 .* does not fit in 1 x A100-80GB"):
        one_gpu = SimConfig.for_engine(replace(engine, tensor_parallel_size=1), model, gpu)
        Simulator(one_gpu).run(trace(1, 1.0))
