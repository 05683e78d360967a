"""What moving a sequence's KV between two replicas costs in the simulator: the prompt's KV
from a prefill replica to a decode replica (cluster/disaggregated_sim.py), a running
sequence's from a replica being removed to another (cluster/cluster_sim.py's migration)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVTransfer:
    """What moving a sequence's KV from one replica to another costs: a fixed latency per
    transfer and the bytes over a bandwidth (NVLink within a node is hundreds of
    GB/s; a 400 Gb/s RDMA NIC between nodes about 50)."""

    bandwidth_bytes_s: float = 50e9
    latency_s: float = 0.002

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_s <= 0 or self.latency_s < 0:
            raise ValueError("need bandwidth_bytes_s > 0 and latency_s >= 0")

    def seconds(self, num_tokens: int, kv_bytes_per_token: float) -> float:
        return self.latency_s + num_tokens * kv_bytes_per_token / self.bandwidth_bytes_s
