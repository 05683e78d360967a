"""A tensor-parallel rank's process (ranks 1..N-1 of an engine replica): it builds its shard's
runner and runs every step rank 0 sends (engine/runner/tensor_parallel.py starts it)."""

from __future__ import annotations

import logging
import os
import pickle
import sys
from multiprocessing.connection import Connection

import torch.distributed as dist

from engine.runner.rank_bundles import connect_to_rank0
from engine.runner.torch_runner import TorchModelRunner

logger = logging.getLogger(__name__)


def run_rank(connection: Connection) -> None:
    """A worker process: build this rank's runner, then run every step rank 0 sends until it
    sends None or rank 0's process ends (the connection closes)."""
    config, shard, port = connection.recv()
    store = dist.TCPStore("127.0.0.1", port, shard.world_size, False)
    runner = TorchModelRunner(config, shard=shard, store=store)
    while True:
        try:
            step = pickle.loads(connection.recv_bytes())
        except (EOFError, OSError):
            break
        if step is None:
            break
        runner.follow(step)
    logger.info("tensor-parallel rank %d (pid %d) stops", shard.rank, os.getpid())


if __name__ == "__main__":
    # python -m engine.runner.rank_process RANK leader=PID fd:N (inherited) | HOST:PORT
    rank, where = sys.argv[1], sys.argv[3]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(message)s")
    if where.startswith("fd:"):
        run_rank(Connection(int(where.removeprefix("fd:"))))
    else:
        run_rank(connect_to_rank0(where))
