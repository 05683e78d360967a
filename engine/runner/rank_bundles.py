"""Tensor-parallel ranks in the bundles of the engine replica's placement group.

Serve places a tensor-parallel engine replica as one placement group of a bundle per rank,
STRICT_PACK (one node; serve_app/deploy/builder.py), the way Ray Serve LLM places vLLM's workers.
The replica itself (rank 0) takes bundle 0; rank r runs in bundle r, started by a small
`RankHost` actor there, so that Ray gives it that bundle's GPU (CUDA_VISIBLE_DEVICES holds one
device: the rank uses cuda:0) and counts its CPUs. The rank process is the same worker as
without a placement group (engine/runner/tensor_parallel.py); it reaches rank 0 over a local
TCP connection instead of an inherited socket (STRICT_PACK keeps them on one node). A
RankHost is owned by the replica and dies with it; its rank then sees its connection close
and ends.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

# The rank process's CUDA device index (its bundle's GPU is the only one it sees).
DEVICE_INDEX_ENV = "DYNABATCH_TP_DEVICE_INDEX"
# The token a rank process sends first on its connection, so rank 0 talks to its own ranks.
TOKEN_ENV = "DYNABATCH_TP_TOKEN"
_CONNECT_TIMEOUT_S = 300.0  # a bundle's actor may wait for its node's GPUs to free up


def current_bundles(world_size: int) -> Any | None:
    """The placement group this process (a Serve replica) runs in, when it has a bundle for
    every rank; None outside Ray or a placement group."""
    if "ray" not in sys.modules:
        return None
    import ray
    from ray.util.placement_group import get_current_placement_group

    if not ray.is_initialized():
        return None
    group = get_current_placement_group()
    if group is None or len(group.bundle_specs) < world_size:
        return None
    return group


class RankHost:
    """A Ray actor in one bundle: starts one rank process and answers how it is."""

    def start(self, command: list[str], env: dict[str, str]) -> int:
        self.process = subprocess.Popen(command, env=os.environ | env)
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, kill: bool) -> None:
        if kill:
            self.process.kill()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


class HostedRank:
    """Rank 0's view of a rank process in a bundle (what RankWorkers asks of a process)."""

    def __init__(self, host: Any, pid: int) -> None:
        self.host, self.pid = host, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import ray

        try:
            self.returncode = ray.get(self.host.poll.remote(), timeout=10)
        except Exception:  # its host (so its bundle's process) is gone
            self.returncode = -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> None:
        """Its end (timeout 0: at once; else the host kills it if not ended within 10 s)."""
        import ray

        with contextlib.suppress(Exception):  # gone already
            ray.get(self.host.stop.remote(timeout == 0), timeout=30)


def start_in_bundle(
    group: Any, rank: int, command: list[str], env: dict[str, str]
) -> tuple[Connection, HostedRank]:
    """Rank `rank`'s process in bundle `rank` of `group`, connected to this process:
    returns (its connection, a HostedRank). `command` is the worker's, without its socket;
    the process learns where to connect from its last argument."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec = dict(group.bundle_specs[rank])
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
    host = (
        ray.remote(RankHost)
        .options(
            num_cpus=spec.pop("CPU", 0),
            num_gpus=spec.pop("GPU", 0),
            resources={k: v for k, v in spec.items() if not k.startswith("memory")},
            scheduling_strategy=strategy,
        )
        .remote()
    )
    token = secrets.token_hex(16)
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(_CONNECT_TIMEOUT_S)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        extra = {TOKEN_ENV: token, DEVICE_INDEX_ENV: "0"}
        pid = ray.get(host.start.remote([*command, address], env | extra))
        while True:
            sock, _ = server.accept()
            connection = Connection(sock.detach())
            if connection.poll(10) and connection.recv_bytes() == token.encode():
                return connection, HostedRank(host, pid)
            connection.close()  # not our rank


def connect_to_rank0(address: str) -> Connection:
    """The hosted rank's side: its connection to rank 0 (the token first)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    connection = Connection(sock.detach())
    connection.send_bytes(os.environ[TOKEN_ENV].encode())
    return connection
