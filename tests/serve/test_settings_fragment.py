"""What POST /v1/cluster/settings accepts of the tuner's fragment, before anything is applied:
knobs that change live amend the settings in force (checked as deploy.yaml is), and a knob
that needs a restart or a redeploy, or a value the replicas were not built for, is refused
naming it. (Applied to a running app under load: tests/serve/test_controller.py.)"""

from __future__ import annotations

import pytest

from cluster.autoscale import AutoscaleConfig
from cluster.batching import policy_factory
from cluster.live_settings import LiveSettings, fingerprint
from cluster.tune.space import Setting
from serve_app.config import AppArgs
from serve_app.ingress.settings_routes import ModelSettings
from serve_app.openai.errors import OpenAIError

DEPLOYED = {
    "model": "models/tiny",
    "engine": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "batching": {"policy": "sla", "batch_size_upper": 128},
    "autoscaling": {"min_replicas": 1, "max_replicas": 4},
}


def model_settings(deployed: dict = DEPLOYED, controller: object = "handle") -> ModelSettings:
    dump = AppArgs.model_validate(deployed).model_dump()
    args = AppArgs.model_validate(dump)
    key = "settings/app/EngineServer"
    return ModelSettings("tiny", args, key, fingerprint(dump), controller, 2.0)


def amend(fragment: dict, model: ModelSettings | None = None) -> LiveSettings:
    model = model or model_settings()
    refused = model.refused(fragment)
    if refused is not None:
        raise refused
    return model.amended(model.as_deployed(), fragment)


def test_the_tuners_fragment_amends_what_is_in_force():
    tuned = Setting(
        policy="memory_aware",
        max_num_seqs=96,
        max_num_batched_tokens=1024,
        eta=0.8,
        min_replicas=2,
        max_replicas=3,
        target_waiting=6.0,
        upscale_delay_s=5.0,
        downscale_delay_s=30.0,
    ).deploy_args()
    settings = amend(tuned)
    assert settings.version == 1 and settings.applied_at is not None
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (96, 1024)
    assert settings.batching["policy"] == "memory_aware" and settings.batching["eta"] == 0.8
    # Knobs the fragment leaves out stay as deployed.
    assert settings.batching["batch_size_upper"] == 128
    rule = AutoscaleConfig(**settings.autoscaling)
    assert (rule.min_replicas, rule.max_replicas, rule.target_waiting) == (2, 3, 6.0)
    assert (rule.upscale_delay_s, rule.downscale_delay_s) == (5.0, 30.0)
    policy = policy_factory(settings.batching, settings.max_num_seqs)()
    assert type(policy).__name__ == "MemoryAwarePolicy" and policy.b == 96
    # A second apply goes on from the first.
    again = model_settings().amended(settings, {"batching": {"policy": "static"}})
    assert again.version == 2 and again.batching["policy"] == "static"
    assert again.max_num_seqs == 96 and again.autoscaling == settings.autoscaling


@pytest.mark.parametrize(
    ("fragment", "param"),
    [
        ({"engine": {"max_model_len": 1024}}, "engine.max_model_len"),
        ({"engine": {"dtype": "bfloat16"}}, "engine.dtype"),
        ({"engine_replicas": {"num_replicas": 2}}, "engine_replicas"),
        ({"autoscaling": {"initial_replicas": 2}}, "autoscaling.initial_replicas"),
        ({"autoscaling": {"look_back_period_s": 9}}, "autoscaling.look_back_period_s"),
        ({"api": {"api_keys": ["k"]}}, "api"),
        ({"engine": {"max_num_sequences": 8}}, "engine.max_num_sequences"),
        ({"batchin": {"policy": "sla"}}, "batchin"),
        ({"batching": "sla"}, "batching"),
        ({"batching": {"policy": "fastest"}}, "batching.policy"),
        ({"batching": {"eta": 1.5}}, "batching.eta"),
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs"),
        ({"engine": {"max_num_seqs": 129}}, "engine.max_num_seqs"),
        ({"batching": {"batch_size_upper": 256}}, "batching.batch_size_upper"),
        ({"engine": {"max_num_batched_tokens": 4096}}, "engine.max_num_batched_tokens"),
        ({"autoscaling": {"max_replicas": 5}}, "autoscaling.max_replicas"),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling"),
        ({"autoscaling": {"target_waiting": 0.2}}, "autoscaling"),
    ],
)
def test_a_knob_that_cannot_change_live_is_refused_naming_it(fragment, param):
    with pytest.raises(OpenAIError) as refused:
        amend(fragment)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
    section, _, knob = param.partition(".")
    assert refused.value.message.startswith(section) and knob in refused.value.message


def test_without_autoscaling_or_a_controller_those_settings_are_refused():
    fixed = {k: v for k, v in DEPLOYED.items() if k != "autoscaling"}
    with pytest.raises(OpenAIError) as refused:
        amend({"autoscaling": {"target_waiting": 2}}, model_settings(fixed))
    assert refused.value.param == "autoscaling"
    alone = model_settings(DEPLOYED, controller=None)
    with pytest.raises(OpenAIError) as refused:
        amend({"batching": {"policy": "static"}}, alone)
    assert refused.value.param == "controller.enabled"
    # The autoscaling rule runs in Serve's controller: it changes without ours.
    assert amend({"autoscaling": {"target_waiting": 2}}, alone).autoscaling["target_waiting"] == 2


def test_a_record_round_trips_and_names_the_args_it_amends():
    settings = amend({"batching": {"policy": "combined"}})
    assert LiveSettings.from_json(settings.to_json()) == settings
    other = dict(DEPLOYED, max_queued_requests=7)
    assert fingerprint(AppArgs.model_validate(other).model_dump()) != settings.deployed


PRICED = {"replica_model": "Llama-2-7B", "replica_gpu": "A100-80GB"}


@pytest.mark.parametrize(
    ("tuning", "message"),
    [
        ({}, "tuning.replica_model: needed"),
        (PRICED | {"space": {"replicas": [2]}}, "tuning.space.replicas: changes only with a"),
        (PRICED | {"space": {"max_num_sequences": [2]}}, "tuning.space.max_num_sequences: one of"),
        (PRICED | {"space": {"max_num_seqs": [64, 512]}}, "tuning.space.max_num_seqs: at most 128"),
        (PRICED | {"space": {"max_replicas": [2, 8]}}, "within the deployed 1..4"),
    ],
)
def test_self_tuning_is_refused_a_knob_or_value_it_could_not_apply(tuning, message):
    with pytest.raises(ValueError, match=message):
        AppArgs.model_validate(DEPLOYED | {"tuning": {"auto": True} | tuning})


def test_self_tuning_needs_the_trace_and_the_controller():
    tuning = {"auto": True} | PRICED
    assert AppArgs.model_validate(DEPLOYED | {"tuning": tuning}).tuning.auto
    for off in ({"trace": {"enabled": False}}, {"controller": {"enabled": False}}):
        with pytest.raises(ValueError, match="tuning.auto: needs trace.enabled"):
            AppArgs.model_validate(DEPLOYED | off | {"tuning": tuning})
