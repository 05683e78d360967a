"""What an engine replica reserves of Ray's CPUs (`engine_replicas.num_cpus: auto`), and how
many engine replicas the cluster's CPUs hold.

On the CPU an engine's threads use every core they are given: a replica that reserved less
(a fraction, so that it and the ingress fit) let Ray place a second engine replica, or another
app's, onto the same busy cores, where both run slower than one alone. So a CPU engine
reserves the cores its threads use, at most what a node has left after the ingress, and
autoscaling stops at the replicas that fit. An emulated replica computes nothing and reserves
nothing; a GPU replica one core for its host work.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from serve_app.config import AppArgs


@dataclass(frozen=True)
class RayCpus:
    """Logical CPUs Ray offers: on the largest node, and in the whole cluster."""

    node: float
    cluster: float

    @staticmethod
    def found() -> RayCpus:
        """Ray's, where it runs; else this machine's cores (one node)."""
        import ray

        if not ray.is_initialized():
            cores = float(len(os.sched_getaffinity(0)))
            return RayCpus(cores, cores)
        nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        return RayCpus(max(nodes, default=0.0), float(ray.cluster_resources().get("CPU", 0.0)))


def ingress_cpus(args: AppArgs) -> float:
    return args.ingress_replicas.num_cpus * args.ingress_replicas.num_replicas


def engine_cpus(args: AppArgs, cpus: RayCpus, num_models: int = 1) -> float:
    """`engine_replicas.num_cpus`, resolved where it is auto (`num_models`: the models of
    the app, which share what the node has left evenly)."""
    share = args.engine_replicas.num_cpus
    if share != "auto":
        return share
    engine = args.engine
    if engine.device == "emulated":
        return 0.0
    if engine.device != "cpu":
        return 1.0
    threads = engine.num_threads * engine.tensor_parallel_size if engine.num_threads else None
    left = (cpus.node - ingress_cpus(args)) / num_models
    return max(min(threads or cpus.node, left), 0.5)


def engine_replicas_that_fit(
    args: AppArgs, engine: float, cpus: RayCpus, num_models: int = 1
) -> int | None:
    """How many engine replicas of `engine` CPUs the cluster holds beside the ingress, in
    one model's even share of it (None: they reserve no CPU)."""
    if engine <= 0:
        return None
    left = (cpus.cluster - ingress_cpus(args)) / num_models
    return max(1, math.floor(left / engine + 1e-9))
