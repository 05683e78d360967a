"""GET and POST /v1/cluster/settings (behind the API key, as every /v1/ route): the batching
and autoscaling settings in force for each model, and settings applied to the running app
without a redeploy. The routes read each model's ModelSettings from the FastAPI app's state.

POST takes the tuner's fragment (deploy.yaml `args:` keys: tuned.yaml) for one model
(`model`: required where the app serves several) and changes what needs no restart:
engine.max_num_seqs and engine.max_num_batched_tokens, every `batching:` knob, and the
autoscaling rule's targets, marks, delays and bounds. It checks the whole as deploy.yaml
would be checked, writes the model's record (cluster/live_settings.py), and waits (briefly)
for the model's cluster controller to take it; the autoscaling rule takes it within its
check period. A knob that needs a restart or a redeploy is a 400 naming it, as is a value
the replicas were not built for: a token budget above the deployed one (their memory was
sized for it), max_num_seqs above what the deployed policy bounds allowed, a replica count
outside the deployed autoscaling bounds (Serve holds the count within them).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from ray.serve.handle import DeploymentHandle

from cluster import live_settings
from cluster.live_settings import LiveSettings
from serve_app.config import AppArgs, first_error, merged
from serve_app.deployment_args import AutoscalingArgs
from serve_app.engine_args import EngineArgs
from serve_app.openai.errors import OpenAIError

LIVE_ENGINE = ("max_num_seqs", "max_num_batched_tokens")
LIVE_AUTOSCALING = (
    "min_replicas",
    "max_replicas",
    "target_waiting",
    "upscale_kv_usage",
    "downscale_waiting",
    "downscale_utilization",
    "upscale_delay_s",
    "downscale_delay_s",
)
_CONFIRM_S = 5.0  # how long a POST waits for the controller to run the new settings

router = APIRouter()


@dataclass
class ModelSettings:
    """One model's settings as deployed, where its applied ones are kept, who runs them."""

    name: str
    declared: AppArgs  # the model's args as deployed
    record_key: str
    deployed: str  # live_settings.fingerprint of the declared args
    controller: DeploymentHandle | None
    report_timeout_s: float

    @classmethod
    def of(
        cls,
        name: str,
        declared: AppArgs,
        dump: dict[str, Any],
        app_name: str,
        engine: DeploymentHandle,
        controller: DeploymentHandle | None,
    ) -> ModelSettings:
        """`dump`: the args as the app was built with them (`declared` validated)."""
        return cls(
            name,
            declared,
            live_settings.key(app_name, engine.deployment_name),
            live_settings.fingerprint(dump),
            controller,
            declared.controller.report_timeout_s,
        )

    def as_deployed(self) -> LiveSettings:
        args = self.declared
        scaling = args.autoscaling
        return LiveSettings(
            self.deployed,
            0,
            None,
            args.engine.max_num_seqs,
            args.engine.max_num_batched_tokens,
            args.batching.model_dump(),
            scaling.rule_config() if scaling is not None else None,
        )

    async def in_force(self) -> LiveSettings:
        applied = await asyncio.to_thread(live_settings.read, self.record_key, self.deployed)
        return applied or self.as_deployed()

    def refused(self, fragment: dict[str, Any]) -> OpenAIError | None:
        """The 400 naming the first knob of `fragment` that cannot change live (None: all
        can, as far as their names go)."""
        # Each section: its fields, those that change live (None: all), what the rest need.
        sections = {
            "engine": (EngineArgs, LIVE_ENGINE, "a restart of the engine replicas (a redeploy)"),
            "autoscaling": (AutoscalingArgs, LIVE_AUTOSCALING, "a redeploy"),
            "batching": (None, None, ""),
        }
        for section, knobs in fragment.items():
            if section not in sections:
                if section in AppArgs.model_fields:
                    return _restart(section, "a redeploy")
                return OpenAIError(400, f"{section}: not a settings field", param=section)
            if not isinstance(knobs, dict):
                return OpenAIError(400, f"{section}: must be an object", param=section)
            model, live, needs = sections[section]
            for knob in knobs if model is not None and live is not None else ():
                name = f"{section}.{knob}"
                if knob not in model.model_fields:
                    return OpenAIError(400, f"{name}: not a settings field", param=name)
                if knob not in live:
                    return _restart(name, needs)
        if "autoscaling" in fragment and self.declared.autoscaling is None:
            message = "autoscaling: this app runs a fixed count of engine replicas (a redeploy)"
            return OpenAIError(400, message, param="autoscaling")
        if self.controller is None and ({"engine", "batching"} & set(fragment)):
            message = (
                "controller.enabled: false, and batching settings change live through the "
                "cluster controller (a redeploy)"
            )
            return OpenAIError(400, message, param="controller.enabled")
        return None

    def amended(self, current: LiveSettings, fragment: dict[str, Any]) -> LiveSettings:
        """`current` with `fragment` applied, checked as deploy.yaml would be and against
        what the replicas were built for; raises OpenAIError (a 400 naming the knob)."""
        deployed = self.declared
        engine = {"max_num_seqs": current.max_num_seqs}
        engine["max_num_batched_tokens"] = current.max_num_batched_tokens
        now: dict[str, Any] = {"engine": engine, "batching": current.batching}
        if current.autoscaling is not None:
            now["autoscaling"] = current.autoscaling
        try:
            # (self-tuning's grid was checked at deploy: not the fragment's to answer for)
            amended = merged(merged(deployed.model_dump(), now), fragment)
            args = AppArgs.model_validate(merged(amended, {"tuning": {"auto": False}}))
        except ValueError as exc:
            text = first_error(exc)
            raise OpenAIError(400, text, param=_named(text, fragment)) from None
        ceiling = max(deployed.engine.max_num_seqs, deployed.batching.batch_size_upper)
        for name, value in (
            ("engine.max_num_seqs", args.engine.max_num_seqs),
            ("batching.batch_size_upper", args.batching.batch_size_upper),
        ):
            if value > ceiling:
                message = (
                    f"{name}: {value} is above {ceiling}, the most the replicas were deployed "
                    "to run (engine.max_num_seqs, batching.batch_size_upper); a redeploy"
                )
                raise OpenAIError(400, message, param=name)
        budget = deployed.engine.max_num_batched_tokens
        if args.engine.max_num_batched_tokens > budget:
            message = (
                f"engine.max_num_batched_tokens: above {budget}, the budget the replicas sized "
                "their memory for; a redeploy"
            )
            raise OpenAIError(400, message, param="engine.max_num_batched_tokens")
        scaling, bounds = args.autoscaling, deployed.autoscaling
        if scaling is not None and bounds is not None:
            if scaling.max_replicas > bounds.max_replicas:
                message = f"autoscaling.max_replicas: above the deployed {bounds.max_replicas}"
                raise OpenAIError(400, f"{message}; a redeploy", param="autoscaling.max_replicas")
            if scaling.min_replicas < bounds.min_replicas:
                message = f"autoscaling.min_replicas: below the deployed {bounds.min_replicas}"
                raise OpenAIError(400, f"{message}; a redeploy", param="autoscaling.min_replicas")
        return LiveSettings(
            self.deployed,
            current.version + 1,
            time.time(),
            args.engine.max_num_seqs,
            args.engine.max_num_batched_tokens,
            args.batching.model_dump(),
            scaling.rule_config() if scaling is not None else None,
        )

    async def confirmed(self, version: int) -> bool:
        """Whether the model's controller runs settings `version` (or later) within a few
        seconds (it reads the record about every second)."""
        if self.controller is None:
            return False
        deadline = time.monotonic() + _CONFIRM_S
        while time.monotonic() < deadline:
            try:
                view = await asyncio.wait_for(
                    self.controller.status.remote(), self.report_timeout_s
                )
                if view.get("settings_version", 0) >= version:
                    return True
            except Exception:  # restarting: it reads the record when it starts
                pass
            await asyncio.sleep(0.2)
        return False


def _named(message: str, fragment: dict[str, Any]) -> str:
    """The knob a check's message names: `section.knob: ...`, or `section: knob ...` for a
    knob the fragment sets (the engine's own checks word it so), else `section`."""
    where, _, rest = message.partition(":")
    words = rest.split()
    section = fragment.get(where)
    if "." not in where and isinstance(section, dict) and words and words[0] in section:
        return f"{where}.{words[0]}"
    return where


def _restart(name: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"{name}: changes only with {what}", param=name)


def _shown(model: ModelSettings, settings: LiveSettings) -> dict[str, Any]:
    return {
        "model": model.name,
        "source": "deploy.yaml" if settings.version == 0 else "applied",
        "version": settings.version,
        "applied_at": settings.applied_at,
        "engine": {
            "max_num_seqs": settings.max_num_seqs,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
        },
        "batching": settings.batching,
        "autoscaling": settings.autoscaling,
    }


@router.get("/v1/cluster/settings")
async def show(request: Request) -> Response:
    """What is in force; with several models, each model's under `models`."""
    models: list[ModelSettings] = request.app.state.settings
    shown = [_shown(model, await model.in_force()) for model in models]
    if len(shown) == 1:
        return JSONResponse(shown[0])
    return JSONResponse({"models": {s["model"]: s for s in shown}})


@router.post("/v1/cluster/settings")
async def apply(request: Request) -> Response:
    """The fragment in the body applied to the model it names."""
    models: list[ModelSettings] = request.app.state.settings
    try:
        body = await request.json()
    except ValueError:
        return OpenAIError(400, "body: not JSON").response()
    if not isinstance(body, dict):
        return OpenAIError(400, "body: must be a JSON object").response()
    fragment = dict(body)
    name = fragment.pop("model", None)
    by_name = {model.name: model for model in models}
    if name is None and len(models) > 1:
        message = "model: required where the app serves several models"
        return OpenAIError(400, message, param="model").response()
    target = models[0] if name is None else by_name.get(name)
    if target is None:
        return OpenAIError.model_not_found(str(name), list(by_name)).response()
    refused = target.refused(fragment)
    if refused is not None:
        return refused.response()
    try:
        settings = target.amended(await target.in_force(), fragment)
    except OpenAIError as exc:
        return exc.response()
    await asyncio.to_thread(live_settings.write, target.record_key, settings)
    confirmed = await target.confirmed(settings.version)
    return JSONResponse(_shown(target, settings) | {"controller_confirmed": confirmed})
