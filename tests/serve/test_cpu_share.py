"""`engine_replicas.num_cpus: auto`: a CPU engine replica reserves the cores its threads use,
so on a 2-core host deploy.yaml's autoscaling stops at one engine replica; an emulated one
reserves nothing and scales as deploy.yaml says (pure: no Ray)."""

from __future__ import annotations

from serve_app.config import AppArgs, merged
from serve_app.deploy.builder import _autoscaling_config
from serve_app.deploy.cpu_share import RayCpus, engine_cpus, engine_replicas_that_fit
from tests.local_serve import deploy_yaml_args

TWO_CORES = RayCpus(node=2.0, cluster=2.0)


def _args(**patch) -> AppArgs:
    return AppArgs.model_validate(merged(deploy_yaml_args(), patch))


def _max_replicas(args: AppArgs, cpus: RayCpus) -> int:
    fit = engine_replicas_that_fit(args, engine_cpus(args, cpus), cpus)
    return _autoscaling_config(args.autoscaling, fit)["max_replicas"]


def test_deploy_yaml_on_two_cores_keeps_one_engine_replica():
    args = _args()
    assert args.engine_replicas.num_cpus == "auto" and args.autoscaling.max_replicas == 2
    # Every core but the ingress's half: no second engine replica fits beside it.
    assert engine_cpus(args, TWO_CORES) == 1.5
    assert _max_replicas(args, TWO_CORES) == 1
    # On 4 cores the threads use all 4: the engine reserves what the ingress leaves.
    four = RayCpus(node=4.0, cluster=4.0)
    assert engine_cpus(args, four) == 3.5 and _max_replicas(args, four) == 1
    # Threads set: the engine reserves them, and as many replicas as fit.
    two_threads = _args(engine={"num_threads": 2})
    assert engine_cpus(two_threads, four) == 2 and _max_replicas(two_threads, four) == 1
    one_thread = _args(engine={"num_threads": 1})
    assert engine_cpus(one_thread, four) == 1 and _max_replicas(one_thread, four) == 2


def test_emulated_replicas_reserve_nothing_and_scale_as_deploy_yaml_says():
    args = _args(engine={"device": "emulated"})
    assert engine_cpus(args, TWO_CORES) == 0
    assert _max_replicas(args, TWO_CORES) == 2


def test_a_number_or_a_gpu_replica_is_taken_as_it_is():
    fixed = _args(engine_replicas={"num_cpus": 0.75})
    assert engine_cpus(fixed, TWO_CORES) == 0.75 and _max_replicas(fixed, TWO_CORES) == 2
    gpu = _args(engine={"device": "cuda"}, engine_replicas={"num_gpus": 1})
    assert engine_cpus(gpu, TWO_CORES) == 1.0


def test_the_models_of_an_app_share_the_node_evenly():
    args = _args()
    four = RayCpus(node=4.0, cluster=4.0)
    # Two models: each engine reserves half of what the ingress leaves, one replica each.
    assert engine_cpus(args, four, num_models=2) == 1.75
    assert engine_replicas_that_fit(args, 1.75, four, num_models=2) == 1
