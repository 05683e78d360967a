"""Disaggregated prefill and decode in the simulator (cluster/disaggregated_sim.py): each
request prefills in one pool and decodes in the other, its KV moved between them at a cost."""

from __future__ import annotations

from cluster.cluster_sim import ClusterSimConfig, ClusterSimulator
from cluster.disaggregated_sim import DisaggregatedConfig, DisaggregatedSimulator
from cluster.kv_transfer import KVTransfer
from cluster.request_records import Slo
from cluster.sim_config import SimConfig
from cluster.workload import SimRequest, make_workload
from engine.runner.cost_model import GPUS, MODELS

CONFIG = SimConfig(MODELS["Llama-3.1-8B"], GPUS["H100-80GB"], slo=Slo(ttft_s=2.0, itl_s=0.05))


def _disaggregated(trace, transfer: KVTransfer | None = None, prefill=1, decode=1):
    setup = DisaggregatedConfig(CONFIG, CONFIG, prefill, decode, transfer or KVTransfer())
    return DisaggregatedSimulator(setup).run(trace)


def test_every_request_prefills_in_one_pool_and_decodes_in_the_other():
    trace = make_workload(60, rate=8.0, seed=3)
    trace.append(SimRequest("one-token", 1.0, 300, 1))  # ends where it prefilled
    result = _disaggregated(trace, prefill=2, decode=2)
    assert set(result.records) == {r.request_id for r in trace}
    for req in trace:
        record = result.records[req.request_id]
        assert record.num_output == req.output_len, req
        assert req.arrival_s < record.first_token_s <= record.finish_s
    assert result.num_transfers == sum(r.output_len > 1 for r in trace)
    kv_bytes = CONFIG.model.kv_bytes_per_token
    assert result.transfer_bytes == sum(r.prompt_len for r in trace if r.output_len > 1) * kv_bytes
    assert result.blocks_free
    summary = result.summary()
    assert summary["finished"] == len(trace) and summary["transfers"] == result.num_transfers


def test_the_transfer_delays_the_second_token_not_the_first():
    trace = make_workload(30, rate=4.0, seed=5)
    fast = _disaggregated(trace, KVTransfer(latency_s=0.0)).records
    slow = _disaggregated(trace, KVTransfer(latency_s=0.5)).records
    for req in trace:
        assert slow[req.request_id].first_token_s == fast[req.request_id].first_token_s
        assert slow[req.request_id].finish_s >= fast[req.request_id].finish_s + 0.5


def test_long_prefills_leave_the_decode_pool_decoding_at_its_own_pace():
    """The reason to disaggregate: colocated, long prompts' chunks share the steps of the
    running decodes and stretch their gaps; in a decode pool nothing but decodes run."""
    decoders = [SimRequest(f"d{i}", 0.0, 32, 40) for i in range(4)]
    prompts = [SimRequest(f"p{i}", 0.01 * (i + 1), 6000, 2) for i in range(8)]
    trace = decoders + prompts
    long_context = CONFIG.with_scheduler(max_model_len=8192)
    colocated = ClusterSimulator(ClusterSimConfig(long_context, initial_replicas=2)).run(trace)
    setup = DisaggregatedConfig(long_context, long_context, 1, 1)
    apart = DisaggregatedSimulator(setup).run(trace)
    alone = DisaggregatedSimulator(setup).run(decoders)
    for d in decoders:
        gap_apart = apart.records[d.request_id].itl
        assert gap_apart < 1.02 * alone.records[d.request_id].itl
        assert gap_apart < 0.5 * colocated.records[d.request_id].itl
