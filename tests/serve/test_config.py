"""deploy.yaml and AppArgs: every field validated, a typo named, defaults sane."""

from __future__ import annotations

import pydantic
import pytest

from serve_app.config import AppArgs
from tests.local_serve import deploy_yaml, deploy_yaml_args


def test_deploy_yaml_args_validate():
    args = AppArgs.model_validate(deploy_yaml_args())
    assert args.model_name == "tiny"
    assert args.engine_replicas.num_gpus == 0
    assert args.replica_capacity == args.engine.max_num_seqs + args.max_queued_requests
    config = args.engine.engine_config(args.model)
    assert config.scheduler.max_model_len == args.engine.max_model_len
    assert config.cache.kv_cache_bytes == args.engine.kv_cache_bytes


def test_load_tests_log_as_deploy_yaml():
    """Load tests start their apps with deploy.yaml's logging (an access-log line per request
    would be CPU on the path they measure)."""
    from serve_app.deploy.local_cluster import APP_LOGGING_CONFIG

    assert deploy_yaml()["logging_config"] == APP_LOGGING_CONFIG


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"max_queued_request": 3}, "max_queued_request"),  # typo of max_queued_requests
        ({"engine": {"max_num_seq": 8}}, "max_num_seq"),
        ({"engine": {"max_num_seqs": 0}}, "max_num_seqs"),
        ({"routing": {"prefix_tokens": 0}}, "prefix_tokens"),
        ({"engine_replicas": {"num_gpu": 1}}, "num_gpu"),
    ],
)
def test_bad_args_name_the_field(patch, field):
    args = deploy_yaml_args()
    for key, value in patch.items():
        args[key] = {**args[key], **value} if isinstance(value, dict) else value
    with pytest.raises(pydantic.ValidationError) as info:
        AppArgs.model_validate(args)
    assert field in str(info.value)


def test_every_field_is_documented():
    from serve_app.config import BatchingArgs, EngineArgs
    from serve_app.deployment_args import ReplicaArgs, RoutingArgs

    for model in (AppArgs, EngineArgs, BatchingArgs, RoutingArgs, ReplicaArgs):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize("policy", ["static", "memory_aware", "sla", "combined"])
def test_batching_args_build_each_policy(policy):
    args = AppArgs.model_validate({**deploy_yaml_args(), "batching": {"policy": policy}})
    built = args.batching.make(args.engine.max_num_seqs)
    assert type(built).__name__.lower().startswith(policy.split("_")[0][:3])


def test_tensor_parallel_replicas_take_one_gpu_per_rank():
    args = deploy_yaml_args()
    args["engine"] = {**args["engine"], "tensor_parallel_size": 4}
    assert AppArgs.model_validate(args).engine.engine_config("m").tensor_parallel_size == 4
    args["engine_replicas"] = {**args["engine_replicas"], "num_gpus": 2}
    with pytest.raises(pydantic.ValidationError, match="num_gpus .2. must equal 4"):
        AppArgs.model_validate(args)
    args["engine"]["tensor_parallel_size"] = 0
    with pytest.raises(pydantic.ValidationError, match="tensor_parallel_size must be >= 1"):
        AppArgs.model_validate(args)


def test_the_model_source_is_validated_and_a_hub_model_named_by_its_id(tiny_model: str):
    assert AppArgs(model="Qwen/Qwen3-8B").model_name == "Qwen/Qwen3-8B"  # as vLLM names it
    assert AppArgs(model="s3://bucket/llama-8b/").model_name == "llama-8b"
    local = AppArgs(model=tiny_model)
    assert local.model_name == "tiny"
    assert local.with_local_model() == local.model_copy(update={"served_model_name": "tiny"})
    with pytest.raises(pydantic.ValidationError, match="unknown scheme 'ftp'"):
        AppArgs(model="ftp://host/model")


def test_a_model_that_cannot_be_fetched_fails_the_deploy_naming_it(tiny_model, monkeypatch):
    """build_app checks a Hub id before any replica starts (tests/hub_server.py plays the
    Hub): one error naming `model`, not replicas failing one by one."""
    from pathlib import Path

    from engine.core.errors import InvalidParam
    from serve_app import build_app
    from tests.hub_server import HubRepo, HubServer

    hub = HubServer({"acme/tiny": HubRepo({"main": Path(tiny_model)})}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    try:
        build_app(dict(deploy_yaml_args(), model="acme/tiny"))
        with pytest.raises(InvalidParam, match="model: acme/missing: not a local directory"):
            build_app(dict(deploy_yaml_args(), model="acme/missing"))
        assert hub.num_downloads() == 0
    finally:
        hub.stop()


def test_make_serve_stops_at_once_naming_a_model_that_cannot_be_fetched(tiny_model, tmp_path):
    """`make serve`'s launcher checks the model before it starts Ray: one line, exit 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from tests.conftest import REPO
    from tests.hub_server import HubRepo, HubServer

    config = deploy_yaml()
    config["applications"][0]["args"]["model"] = "acme/missing"
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    hub = HubServer({"acme/tiny": HubRepo({"main": Path(tiny_model)})}).start()
    try:
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint)
        command = [sys.executable, "-m", "serve_app.deploy.launch", str(path)]
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    finally:
        hub.stop()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        f"{path}: model: acme/missing: not a local directory, nor a repo at {hub.endpoint}"
    )


def test_several_models_take_the_top_level_fields_as_their_defaults():
    args = AppArgs.model_validate(
        deploy_yaml_args()
        | {
            "model": None,
            "served_model_name": None,
            "models": [
                {"model": "models/tiny"},
                {
                    "model": "acme/small",
                    "engine": {"max_num_seqs": 8, "lora": {"enabled": True}},
                    "engine_replicas": {"num_replicas": 3},
                    "autoscaling": None,
                    "delta_channels": False,
                    "delta_links": None,
                },
            ],
            "engine": deploy_yaml_args()["engine"] | {"block_size": 32},
            "delta_links": False,
        }
    )
    tiny, small = args.per_model()
    assert (tiny.model_name, small.model_name) == ("tiny", "acme/small")
    assert tiny.engine == AppArgs.model_validate(deploy_yaml_args()).engine.model_copy(
        update={"block_size": 32}
    )  # nothing of its own: the top level's
    # A section set in an entry is merged over the top level's key by key.
    assert (small.engine.block_size, small.engine.max_num_seqs) == (32, 8)
    assert small.engine.lora.enabled and small.engine.lora.max_loras == tiny.engine.lora.max_loras
    assert small.engine_replicas.num_replicas == 3 and small.engine_replicas.num_cpus == "auto"
    assert tiny.autoscaling is not None and small.autoscaling is None  # explicit null: fixed
    assert (tiny.delta_channels, small.delta_channels) == (True, False)
    assert not tiny.delta_links and not small.delta_links  # null: the top level's
    assert tiny.api == small.api == args.api  # app-wide: entries cannot set it


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"model": "models/tiny", "models": [{"model": "models/tiny"}]},
            "set either `model` or `models`",
        ),
        ({"model": None}, "model: required"),
        (
            {"model": None, "served_model_name": "tiny", "models": [{"model": "models/tiny"}]},
            "served_model_name: with `models`, set in each entry",
        ),
        (
            {
                "model": None,
                "served_model_name": None,
                "models": [{"model": "models/tiny"}, {"model": "x/y", "served_model_name": "tiny"}],
            },
            "models[1].served_model_name: 'tiny' is also models[0]'s",
        ),
        (
            {"models": [{"model": "models/tiny", "engine": {"max_num_seqs": 0}}]},
            "models[0] (models/tiny): engine: max_num_seqs must be >= 1",
        ),
        (
            {"models": [{"model": "models/tiny", "engine": {"dtpye": "x"}}]},
            "models[0] (models/tiny): engine.dtpye: Extra inputs are not permitted",
        ),
        ({"models": [{"model": "models/tiny", "api": {}}]}, "models.0.api"),
    ],
)
def test_a_bad_models_entry_is_named(patch, message):
    with pytest.raises(pydantic.ValidationError) as err:
        several = {"model": None, "served_model_name": None} if "models" in patch else {}
        AppArgs.model_validate(deploy_yaml_args() | several | patch)
    assert message in str(err.value)


def test_an_ingress_replica_drains_longer_than_an_engine_replica(tiny_model: str):
    """Its clients' connections end there and cannot move: a redeploy keeps it serving them."""
    from serve_app import build_app

    args = dict(deploy_yaml_args(), model=tiny_model)
    args["health"] = {"graceful_shutdown_timeout_s": 30, "ingress_graceful_shutdown_timeout_s": 900}
    ingress = build_app(args)._bound_deployment
    assert ingress.name == "OpenAIIngress"
    assert ingress._deployment_config.graceful_shutdown_timeout_s == 900
    engines = _engine_deployments(ingress)
    assert engines and engines[0]._deployment_config.graceful_shutdown_timeout_s == 30


def test_the_control_plane_is_health_checked_as_the_engines_are(tiny_model: str):
    """The controller, the boards and the stores answer Serve's checks as often and as soon as
    an engine replica must: one that stops answering (cut off from the network) is replaced in
    seconds, not after Serve's defaults (three checks of 30 s)."""
    from serve_app import build_app

    args = dict(deploy_yaml_args(), model=tiny_model)
    args["health"] = {"check_period_s": 1.5, "check_timeout_s": 4}
    args["trace"], args["api"] = {"enabled": True}, {"stored_responses": 10}
    args["engine"] = args.get("engine", {}) | {"lora": {"enabled": True}}
    ingress = build_app(args)._bound_deployment
    bound = _bound_deployments(ingress)
    names = {d.name for d in bound}
    assert {"ClusterController", "AppTables", "LoRABoard", "EngineServer"} == names, names
    for deployment in bound:
        config = deployment._deployment_config
        assert (config.health_check_period_s, config.health_check_timeout_s) == (1.5, 4), (
            deployment.name
        )


def test_building_the_app_leaves_cloudpickle_registry_alone(tiny_model: str, monkeypatch):
    """Serve would pickle the engines' router by value, registering and unregistering its
    module process-wide around it, which fails when a handle's thread does the same at once
    (seen in a redeploy): the router goes by reference, pickled once."""
    from ray import cloudpickle

    from serve_app import build_app
    from serve_app.transport.router import LoadAwareRouter

    register = cloudpickle.register_pickle_by_value

    def refuse_ours(module):
        assert not module.__name__.startswith("serve_app"), f"{module} pickled by value"
        register(module)

    monkeypatch.setattr(cloudpickle, "register_pickle_by_value", refuse_ours)
    ingress = build_app(dict(deploy_yaml_args(), model=tiny_model))._bound_deployment
    engines = _engine_deployments(ingress)
    router = engines[0]._deployment_config.request_router_config
    assert cloudpickle.loads(router._serialized_request_router_cls) is LoadAwareRouter


def _bound_deployments(ingress) -> list:
    """Every deployment a built app's ingress is bound to (its arguments hold each model's
    deployments in lists, the app-wide ones alone)."""
    from cluster.app_tables import Table

    apps = []
    for arg in ingress.init_args:
        apps += arg if isinstance(arg, list) else [arg]
    apps = [app.handle if isinstance(app, Table) else app for app in apps]
    return [app._bound_deployment for app in apps if hasattr(app, "_bound_deployment")]


def test_the_app_wide_tables_share_one_actor(tiny_model: str):
    """The metrics board, the traffic trace and the response store are tables of one
    AppTables deployment (one idle actor instead of three), each reached by its name."""
    from cluster.app_tables import Table
    from serve_app import build_app

    args = dict(deploy_yaml_args(), model=tiny_model)
    args["trace"], args["api"] = {"enabled": True}, {"stored_responses": 10}
    tables = [a for a in build_app(args)._bound_deployment.init_args if isinstance(a, Table)]
    assert sorted(t.name for t in tables) == ["metrics", "responses", "trace"]
    assert len({id(t.handle) for t in tables}) == 1
    (held,) = tables[0].handle._bound_deployment.init_args
    assert sorted(held) == ["metrics", "responses", "trace"]


def _engine_deployments(ingress) -> list:
    """The engine deployments a built app's ingress is bound to."""
    return [d for d in _bound_deployments(ingress) if d.name.startswith("EngineServer")]


def test_disaggregation_adds_a_prefill_pool_per_model(tiny_model: str):
    """A prefill deployment of EngineServer replicas in prefill_only mode, its own fixed
    count and CPUs, beside the decode pool (the engine deployment, autoscaled as set),
    tensor-parallel engines too (their KV moves whole: tests/engine/test_tensor_parallel.py)."""
    from serve_app import build_app
    from serve_app.deploy.builder import PREFILL_SERVER

    args = dict(deploy_yaml_args(), model=tiny_model)
    args["disaggregation"] = {"prefill_replicas": {"num_replicas": 3, "num_cpus": 0.25}}
    ingress = build_app(args)._bound_deployment
    (prefill_pool,) = [app._bound_deployment for app in ingress.init_args[7]]
    assert prefill_pool.name == PREFILL_SERVER
    assert prefill_pool._deployment_config.num_replicas == 3
    assert prefill_pool._deployment_config.autoscaling_config is None
    assert prefill_pool.ray_actor_options["num_cpus"] == 0.25
    assert prefill_pool.init_args[1] is None and prefill_pool.init_args[3] is True
    (decode_pool,) = _engine_deployments(ingress)
    assert decode_pool.init_args[3] is False
    assert decode_pool._deployment_config.autoscaling_config is not None  # deploy.yaml's
    plain = build_app(dict(deploy_yaml_args(), model=tiny_model))._bound_deployment
    assert plain.init_args[7] == [None]
    tp = AppArgs.model_validate(args | {"engine": {"tensor_parallel_size": 2}})
    assert tp.prefill_pool().engine.tensor_parallel_size == 2
    # The prefill pool's own ranks (the KV moves whole), a GPU each.
    gpus = {"num_replicas": 1, "num_gpus": 1}
    wide = {"prefill_replicas": gpus, "prefill_engine": {"tensor_parallel_size": 2}}
    with pytest.raises(ValueError, match="prefill_replicas.num_gpus .1. must equal 2"):
        AppArgs.model_validate(args | {"disaggregation": wide})


def test_a_prefill_pool_batches_caches_and_scales_by_its_own_settings(tiny_model: str):
    """`prefill_engine` over `engine` for the prefill pool only; `prefill_autoscaling` scales
    it on its queue depth; a knob that shapes its KV or its first token is refused, named."""
    from serve_app import build_app

    args = dict(deploy_yaml_args(), model=tiny_model)
    args["disaggregation"] = {
        "prefill_replicas": {"num_cpus": 0.25},
        "prefill_engine": {"max_num_batched_tokens": 8192, "max_num_seqs": 8},
        "prefill_autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_waiting": 2},
    }
    ingress = build_app(args)._bound_deployment
    (prefill_pool,) = [app._bound_deployment for app in ingress.init_args[7]]
    (decode_pool,) = _engine_deployments(ingress)
    prefill_engine, decode_engine = (
        prefill_pool.init_args[0]["engine"],
        decode_pool.init_args[0]["engine"],
    )
    assert (prefill_engine["max_num_batched_tokens"], prefill_engine["max_num_seqs"]) == (8192, 8)
    assert decode_engine["max_num_batched_tokens"] == deploy_yaml_args()["engine"].get(
        "max_num_batched_tokens", 2048
    )
    assert prefill_engine["block_size"] == decode_engine["block_size"]
    scaling = prefill_pool._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 3)
    assert scaling.policy.policy_kwargs["target_waiting"] == 2
    assert prefill_pool._deployment_config.max_ongoing_requests < (
        decode_pool._deployment_config.max_ongoing_requests
    )  # its own batch (8) and queue
    for knob, value in (("block_size", 32), ("dtype", "bfloat16"), ("max_model_len", 256)):
        bad = args | {"disaggregation": {"prefill_engine": {knob: value}}}
        with pytest.raises(ValueError, match=f"prefill_engine\n.*{knob}: not a knob"):
            AppArgs.model_validate(bad)
    bad = args | {"disaggregation": {"prefill_engine": {"max_num_seqs": 0}}}
    with pytest.raises(ValueError, match="disaggregation.prefill_engine.max_num_seqs"):
        AppArgs.model_validate(bad)
    bad = args | {"disaggregation": {"prefill_autoscaling": {"min_replicas": 3, "max_replicas": 2}}}
    with pytest.raises(ValueError, match="prefill_autoscaling"):
        AppArgs.model_validate(bad)
