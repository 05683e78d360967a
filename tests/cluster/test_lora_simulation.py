"""The simulator prices LoRA steps: adapter rows add their shrink and expand FLOPs and each
adapter's weights read, and the real scheduler's slots make requests wait for an adapter
where more are asked for than a replica holds."""

from __future__ import annotations

from dataclasses import replace

from cluster.sim_config import SimConfig
from cluster.simulator import Simulator
from cluster.workload import make_workload
from engine.core.lora_config import LoRAConfig
from engine.runner.cost_model import GPUS, MODELS

N = 120


def run(lora: LoRAConfig | None, adapters: int = 0, zipf: bool = False):
    config = SimConfig(model=MODELS["Llama-3.1-8B"], gpu=GPUS["H100-80GB"])
    if lora is not None:
        config = replace(config, lora=lora)
    trace = make_workload(N, 8.0, "poisson", seed=5, adapters=adapters, adapter_zipf=zipf)
    simulator = Simulator(config.with_scheduler(max_num_seqs=64))
    result = simulator.run(trace)
    assert result.summary()["finished"] == N
    assert result.free_blocks_at_end == result.num_kv_blocks
    return result


def test_adapter_rows_cost_a_little_more_than_base_rows():
    base = run(None).summary()
    lora = LoRAConfig(enabled=True, max_loras=16, max_lora_rank=64)
    adapted = run(lora, adapters=16).summary()
    assert base["itl_p50_s"] < adapted["itl_p50_s"] < 1.3 * base["itl_p50_s"]
    # The same trace with no adapter named: priced as the base.
    assert run(lora).summary()["itl_p50_s"] == base["itl_p50_s"]


def test_more_adapters_than_slots_wait_their_turn():
    roomy = run(LoRAConfig(enabled=True, max_loras=16), adapters=16, zipf=True).summary()
    tight = run(LoRAConfig(enabled=True, max_loras=2), adapters=16, zipf=True).summary()
    assert tight["ttft_p99_s"] > roomy["ttft_p99_s"]
