"""Disaggregated prefill and decode on one timeline: a prefill pool and a decode pool of
SimReplicas (the real scheduler each, a priced runner), the KV moved between them at a
bandwidth.

A request arrives at the prefill replica with the fewest requests and runs there with
max_tokens 1: its prompt's prefill, and its first token, which the client gets then. Its
prompt's KV then travels to the decode replica with the fewest requests (ties: the one with
the most free KV) in `KVTransfer.seconds` and decodes there; its first step there computes
only the token after the carried KV (engine/core/sequence_kv.py, as a moved sequence's does
in the engine). The prefill replica frees its blocks when the prefill ends rather than when
the transfer does: a prefill replica's cache, which holds no decoding sequence, is not what
binds. A request of one output token ends at its prefill replica.

The colocated fleet it compares with is the ClusterSimulator's (cluster/cluster_sim.py) with
a fixed count of replicas: every replica prefills and decodes, long prompts in chunks.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, replace

from cluster.kv_transfer import KVTransfer
from cluster.request_records import RequestRecord, summarize_records
from cluster.sim_config import SimConfig
from cluster.sim_replica import SimReplica
from cluster.simulator import gc_paused
from cluster.workload import SimRequest
from engine.core.request import Request


@dataclass(frozen=True)
class DisaggregatedConfig:
    prefill: SimConfig
    decode: SimConfig
    num_prefill: int
    num_decode: int
    transfer: KVTransfer = KVTransfer()

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode replica")

    @property
    def num_replicas(self) -> int:
        return self.num_prefill + self.num_decode


@dataclass
class DisaggregatedResult:
    config: DisaggregatedConfig
    records: dict[str, RequestRecord]
    duration_s: float
    num_transfers: int
    transfer_seconds: float  # summed over the transfers
    transfer_bytes: float
    blocks_free: bool  # every replica's KV cache wholly free at the end

    def summary(self) -> dict[str, float]:
        c = self.config
        return summarize_records(self.records, c.decode.slo, self.duration_s) | {
            "prefill_replicas": c.num_prefill,
            "decode_replicas": c.num_decode,
            "transfers": self.num_transfers,
            "transfer_ms_mean": 1e3 * self.transfer_seconds / max(self.num_transfers, 1),
            "transfer_gb": self.transfer_bytes / 1e9,
        }


class DisaggregatedSimulator:
    def __init__(self, config: DisaggregatedConfig) -> None:
        self.config = config

    def run(self, trace: list[SimRequest], max_sim_s: float = math.inf) -> DisaggregatedResult:
        with gc_paused():
            return self._run(trace, max_sim_s)

    def _run(self, trace: list[SimRequest], max_sim_s: float) -> DisaggregatedResult:
        c = self.config
        records: dict[str, RequestRecord] = {}
        prefill_records: dict[str, RequestRecord] = {}
        asked: dict[str, SimRequest] = {}
        # (ready at the decode pool, order, the request, its first token's time)
        in_flight: list[tuple[float, int, SimRequest, float]] = []
        kv_bytes_per_token = c.decode.model.kv_bytes_per_token
        moved = {"count": 0, "seconds": 0.0, "bytes": 0.0}

        def prefilled(request: Request, t: float) -> None:
            req = asked.pop(request.request_id)
            if req.output_len <= 1:  # done: its one token came from the prefill
                records[req.request_id] = prefill_records.pop(req.request_id)
                return
            del prefill_records[req.request_id]
            seconds = c.transfer.seconds(req.prompt_len, kv_bytes_per_token)
            moved["count"] += 1
            moved["seconds"] += seconds
            moved["bytes"] += req.prompt_len * kv_bytes_per_token
            heapq.heappush(in_flight, (t + seconds, moved["count"], req, t))

        prefill = [
            SimReplica(c.prefill, prefill_records, on_finish=prefilled)
            for _ in range(c.num_prefill)
        ]
        decode = [SimReplica(c.decode, records) for _ in range(c.num_decode)]
        replicas = prefill + decode
        pending = deque(sorted(trace, key=lambda r: r.arrival_s))
        t = 0.0
        while True:
            busy = [r for r in replicas if r.busy]
            if not pending and not in_flight and not busy:
                break
            t_arrival = pending[0].arrival_s if pending else math.inf
            t_ready = in_flight[0][0] if in_flight else math.inf
            stepper = min(busy, key=lambda r: r.clock.now(), default=None)
            t_step = stepper.clock.now() if stepper is not None else math.inf
            t = min(t_arrival, t_ready, t_step)
            if t > max_sim_s:
                break
            if t_arrival <= min(t_ready, t_step):
                req = pending.popleft()
                asked[req.request_id] = req
                target = min(prefill, key=lambda r: r.num_requests)
                target.add(replace(req, output_len=1))
            elif t_ready <= t_step:
                ready_s, _, req, first_token_s = heapq.heappop(in_flight)
                target = min(decode, key=lambda r: (r.num_requests, r.scheduler.stats().kv_usage))
                target.add(req, prefilled_s=first_token_s, at_s=ready_s)
            else:
                assert stepper is not None
                stepper.advance(min(t_arrival, t_ready))
        end = max([t if math.isfinite(t) else 0.0] + [r.clock.now() for r in replicas])
        free = all(
            (stats := r.scheduler.stats()).num_free_blocks == stats.num_total_blocks
            for r in replicas
        )
        return DisaggregatedResult(
            c, records, end, moved["count"], moved["seconds"], moved["bytes"], free
        )
