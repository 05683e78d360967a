"""The simulator sees quantization as the engine does: an FP8 KV cache holds twice the blocks
in the same memory and moves the memory-aware rule; FP8 and INT4 weights are fewer bytes per
step, and FP8 GEMMs run at the FP8 peak only on GPUs that have one."""

from __future__ import annotations

from dataclasses import replace

from cluster.sim_config import SimConfig
from cluster.simulator import Simulator
from cluster.workload import CHAT_OUTPUT, CHAT_PROMPT, make_workload
from engine.core.clock import VirtualClock
from engine.core.config import CacheConfig, EngineConfig
from engine.core.outputs import ScheduledRequest, SchedulerOutput
from engine.core.sampling_params import SamplingParams
from engine.runner.cost_model import GPUS, MODELS, CostModelRunner, step_cost
from loadtests.bench_quant_sim import config_for


def _blocks(kv: str, model: str = "Llama-2-13B", gpu: str = "A100-40GB") -> int:
    cache = CacheConfig(kv_cache_dtype=kv)
    return CostModelRunner(MODELS[model], GPUS[gpu], VirtualClock(), cache=cache).num_kv_blocks()


def test_an_fp8_kv_cache_holds_twice_the_blocks_in_the_same_memory():
    bf16, fp8 = _blocks("auto"), _blocks("fp8_e4m3")
    assert fp8 in (2 * bf16, 2 * bf16 + 1)  # floor of twice the same quotient
    model = MODELS["Llama-2-13B"]
    assert model.quantized(kv_cache_dtype="fp8_e4m3").kv_bytes_per_token * 2 == (
        model.kv_bytes_per_token
    )


def _decode_step(batch: int, context: int) -> SchedulerOutput:
    params = SamplingParams(max_tokens=1)
    scheduled = [
        ScheduledRequest(f"r{i}", [1], context, list(range(context // 16 + 1)), True, params, 0)
        for i in range(batch)
    ]
    return SchedulerOutput(scheduled=scheduled, num_batched_tokens=batch)


def test_quantized_weights_are_fewer_bytes_and_fp8_gemms_need_an_fp8_gpu():
    model = MODELS["Llama-3.1-8B"]
    fp8, int4 = model.quantized("fp8"), model.quantized("int4")
    layers = model.num_layers * model.layer_params
    assert model.weight_bytes - fp8.weight_bytes == layers  # one byte less per weight
    assert int4.weight_bytes < fp8.weight_bytes < model.weight_bytes
    decode = _decode_step(64, 1000)
    for gpu in ("H100-80GB", "A100-80GB"):
        costs = [
            step_cost(decode, m, GPUS[gpu], SimConfig(m, GPUS[gpu]).cost)
            for m in (model, fp8, int4)
        ]
        assert costs[0].bytes > costs[1].bytes > costs[2].bytes
        assert costs[0].seconds > costs[1].seconds > costs[2].seconds  # decode: memory-bound
    chunk = ScheduledRequest("p", [1] * 4096, 0, list(range(256)), True, SamplingParams(), 0)
    prefill = SchedulerOutput(scheduled=[chunk], num_batched_tokens=4096)
    params = SimConfig(model, GPUS["H100-80GB"]).cost
    h100 = [step_cost(prefill, m, GPUS["H100-80GB"], params).seconds for m in (model, fp8)]
    a100 = [step_cost(prefill, m, GPUS["A100-80GB"], params).seconds for m in (model, fp8)]
    assert h100[1] < 0.7 * h100[0]  # compute-bound prefill at the FP8 peak
    assert a100[1] == a100[0]  # no FP8 tensor cores: FP8 weights save bytes, not FLOPs


def test_the_memory_aware_rule_admits_more_with_an_fp8_kv_cache():
    """Llama-2-13B on an A100-40GB is KV-bound: the rule's max_num_seqs rises with the blocks."""
    trace = make_workload(120, 12.0, "poisson", CHAT_PROMPT, CHAT_OUTPUT, seed=0)
    chosen = {}
    for kv in ("auto", "fp8_e4m3"):
        result = Simulator(config_for("Llama-2-13B", "A100-40GB", None, kv)).run(trace)
        values = [n for _, n in result.max_num_seqs_series]
        chosen[kv] = sum(values) / len(values)
    assert chosen["fp8_e4m3"] > 1.5 * chosen["auto"]


def test_an_engine_configs_quantization_reaches_its_simulated_replica():
    engine = EngineConfig(
        model="unused", quantization="fp8", cache=CacheConfig(kv_cache_dtype="fp8_e4m3")
    )
    config = SimConfig.for_engine(engine, MODELS["Llama-3.1-8B"], GPUS["H100-80GB"])
    assert config.model.fp8_gemms and config.model.linear_bytes == 1.0
    assert config.cache.kv_cache_dtype == "fp8_e4m3"
    plain = SimConfig.for_engine(
        replace(engine, quantization=None), MODELS["Llama-3.1-8B"], config.gpu
    )
    assert not plain.model.fp8_gemms and plain.model.linear_bytes is None
