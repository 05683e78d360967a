"""Tensor parallelism inside one engine replica: rank 0 runs in the engine's process (it
schedules and samples); ranks 1..N-1 are worker processes it starts, each running the same
forward on its shard (engine/model/sharding.py) for every step rank 0 sends them.

The collectives (engine/model/collectives.py) sit below the decoder, which calls them. Steps go
to the workers over socket pairs as plain data: a worker waits on its socket however long the
engine is idle, and ends when rank 0's process is gone (the connection closes).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from engine.model.sharding import Shard
from engine.runner.rank_bundles import (
    HostedRank,
    current_bundles,
    start_in_bundle,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatherKV:
    """Sent to ranks 1..N-1 in place of a step: read these blocks' share of the heads and
    join rank 0's gather of them (a sequence's KV leaving the replica)."""

    block_ids: list[int]
    swapped: bool  # the blocks are the host pool's


class RankWorkers:
    """Rank 0's handle on ranks 1..N-1: their processes and the connections that carry
    steps. Each worker is a fresh interpreter (`python -m engine.runner.rank_process`), not
    a fork of an engine process that holds threads and a loop, nor multiprocessing's spawn,
    which would import the caller's main script again."""

    def __init__(self, config: Any, world_size: int) -> None:
        # Port 0: the store listens where the system lets it; workers learn the port.
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
        path = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.processes: list[subprocess.Popen | HostedRank] = []
        self._connections: list[Connection] = []
        # In a Serve replica placed as a bundle per rank, each rank runs in its own bundle.
        module = "engine.runner.rank_process"
        bundles = current_bundles(world_size)
        try:
            for rank in range(1, world_size):
                # The leader's pid in the command line: `ps` tells which replica a rank serves.
                command = [sys.executable, "-m", module, str(rank), f"leader={os.getpid()}"]
                if bundles is not None:
                    connection, process = start_in_bundle(bundles, rank, command, path)
                else:
                    ours, theirs = socket.socketpair()
                    command.append(f"fd:{theirs.fileno()}")
                    env = os.environ | path
                    process = subprocess.Popen(command, env=env, pass_fds=[theirs.fileno()])
                    theirs.close()
                    connection = Connection(ours.detach())
                self.processes.append(process)
                self._connections.append(connection)
                shard = Shard(rank, world_size, config.expert_parallel)
                connection.send((config, shard, self.store.port))
        except BaseException:
            self.close(kill=True)
            raise

    def send(self, step: Any) -> None:
        """Every worker gets the step (None: stop). Raises RuntimeError naming a dead rank."""
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)  # once for every rank
        try:
            for connection in self._connections:
                connection.send_bytes(data)
        except OSError as exc:
            raise RuntimeError(self.problem() or f"tensor-parallel rank lost: {exc!r}") from exc

    def problem(self) -> str | None:
        """Which rank's process has ended, or None while all live."""
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return (
                    f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                    f"{process.returncode}"
                )
        return None

    def close(self, kill: bool = False) -> None:
        """Stop every worker: after its step (None on its connection), or at once."""
        for connection in self._connections:
            try:
                if not kill:
                    connection.send_bytes(pickle.dumps(None))
                connection.close()
            except OSError:
                pass
        for process in self.processes:
            try:
                process.wait(timeout=0 if kill else 10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class RankedStep:
    """Rank 0's share of a step the other ranks run too: a failure, whether at launch or
    when the step is collected (on a GPU, where collectives run behind the host), is raised
    naming the rank whose process ended, where one did."""

    def __init__(self, workers: RankWorkers, launch: Callable[[], Any]) -> None:
        self._workers = workers
        self._step = self._naming_ranks(launch)
        self.ready = self._step.ready

    def result(self) -> Any:
        return self._naming_ranks(self._step.result)

    def _naming_ranks(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            problem = self._workers.problem()
            if problem is None:
                raise
            raise RuntimeError(problem) from exc
