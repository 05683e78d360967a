"""How many threads an engine's torch ops (and our CPU kernels) use."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def set_engine_threads(num_threads: int | None, device: str, world_size: int = 1) -> int:
    """torch's intra-op threads for this engine (our CPU kernels use as many): `num_threads`,
    or on the CPU every core this process may run on (Ray sets OpenMP's count from the
    replica's fractional `num_cpus`, which would leave cores idle) shared by the engine's
    `world_size` ranks, or on a GPU node what Ray gave the process. Logged, and returned."""
    if num_threads:
        why = "engine.num_threads"
    elif device == "cpu":
        num_threads = max(len(os.sched_getaffinity(0)) // world_size, 1)
        why = "the cores this process may run on"
        if world_size > 1:
            why += f", shared by {world_size} tensor-parallel ranks"
    else:
        num_threads = torch.get_num_threads()
        why = "torch's default from the process's resources"
    torch.set_num_threads(num_threads)
    logger.info("engine threads: %d (%s)", num_threads, why)
    return num_threads
