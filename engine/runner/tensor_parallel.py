"""Tensor parallelism inside one engine replica: rank 0 runs in the engine's process (it
schedules and samples); ranks 1..N-1 are worker processes it starts, each running the same
forward on its shard (engine/model/sharding.py) for every step rank 0 sends them.

Collectives go through a process group of our own (gloo on the CPU, NCCL on CUDA), not
torch.distributed's global one, so a process may hold several engines (tests do). Steps go
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
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from engine.model.sharding import Shard

logger = logging.getLogger(__name__)

# A collective waits this long for the other ranks (a step's slowest layer, not idle time:
# workers wait for steps on their sockets). A hung rank shows before that in the replica's
# health (step_timeout_s).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class TensorParallel:
    """One rank's collectives over the ranks of its engine."""

    def __init__(self, shard: Shard, store: dist.Store, device: torch.device) -> None:
        self.shard = shard
        self.device = device
        store = dist.PrefixStore("dynabatch-tp", store)
        rank, size = shard.rank, shard.world_size
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            self._group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """The elementwise reduction over ranks (in place where `t` is contiguous)."""
        t = t.contiguous()
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._group.allreduce([t], options).wait()
        return t

    def all_gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, c] on each rank -> [rows, N x c], rank 0's columns first."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.shard.world_size)]
        self._group.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=1)

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every rank's `t` (contiguous, the same shape and dtype)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([t], options).wait()

    def min(self, value: int) -> int:
        """The least of every rank's `value` (e.g. the KV blocks each rank's memory holds)."""
        mine = torch.tensor([value], device=self.device)  # NCCL reduces device tensors only
        return int(self.all_reduce(mine, dist.ReduceOp.MIN).item())


class RankWorkers:
    """Rank 0's handle on ranks 1..N-1: their processes and the connections that carry
    steps. Each worker is a fresh interpreter (`python -m` this module), not a fork of an
    engine process that holds threads and a loop, nor multiprocessing's spawn, which would
    import the caller's main script again."""

    def __init__(self, config: Any, world_size: int) -> None:
        # Port 0: the store listens where the system lets it; workers learn the port.
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.processes: list[subprocess.Popen] = []
        self._connections: list[Connection] = []
        for rank in range(1, world_size):
            ours, theirs = socket.socketpair()
            command = [sys.executable, "-m", __name__, str(theirs.fileno()), str(rank)]
            process = subprocess.Popen(command, env=env, pass_fds=[theirs.fileno()])
            theirs.close()
            connection = Connection(ours.detach())
            connection.send((config, Shard(rank, world_size), self.store.port))
            self.processes.append(process)
            self._connections.append(connection)

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


def run_rank(connection: Connection) -> None:
    """A worker process: build this rank's runner, then run every step rank 0 sends until it
    sends None or rank 0's process ends (the connection closes)."""
    config, shard, port = connection.recv()
    from engine.runner.torch_runner import TorchModelRunner

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
    fd, rank = int(sys.argv[1]), sys.argv[2]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(message)s")
    run_rank(Connection(fd))
