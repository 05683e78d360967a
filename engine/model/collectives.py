"""What the decoder and its weight loader need of tensor parallelism: one rank's collectives
over the ranks of its engine (engine/runner/tensor_parallel.py starts the ranks and sends them
steps).

Collectives go through a process group of our own (gloo on the CPU, NCCL on CUDA), not
torch.distributed's global one, so a process may hold several engines (tests do).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.model.sharding import Shard

# A collective waits this long for the other ranks (a step's slowest layer, not idle time:
# workers wait for steps on their sockets). A hung rank shows before that in the replica's
# health (step_timeout_s).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def process_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta
) -> Any:
    """A group of our own over `store` (prefixed by the caller): NCCL for CUDA tensors,
    gloo for CPU ones (a torch backend: send, recv and the collectives)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class TensorParallel:
    """One rank's collectives over the ranks of its engine."""

    def __init__(self, shard: Shard, store: dist.Store, device: torch.device) -> None:
        self.shard = shard
        self.device = device
        store = dist.PrefixStore("dynabatch-tp", store)
        self._group = process_group(store, shard.rank, shard.world_size, device, COLLECTIVE_TIMEOUT)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """The elementwise reduction over ranks (in place where `t` is contiguous)."""
        t = t.contiguous()
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._group.allreduce([t], options).wait()
        return t

    def all_gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, c] on each rank -> [rows, N x c], rank 0's columns first."""
        return self.all_gather(t, dim=1)

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `t` (the same shape) joined along `dim`, rank 0's first."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.shard.world_size)]
        self._group.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every rank's `t` (contiguous, the same shape and dtype)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([t], options).wait()

    def min(self, value: int) -> int:
        """The least of every rank's `value` (e.g. the KV blocks each rank's memory holds)."""
        mine = torch.tensor([value], device=self.device)  # NCCL reduces device tensors only
        return int(self.all_reduce(mine, dist.ReduceOp.MIN).item())
