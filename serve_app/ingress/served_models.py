"""The models an ingress replica serves, each with what its requests go through (its
tokenizer and chat template, its adapters, its engine client and delta channels, its
services), and the choice among them by a request's `model`: a base model's served name, a
LoRA adapter as `base:adapter`, or an adapter's own name."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from ray.serve.handle import DeploymentHandle

from engine.core.lora_config import LoRAConfig
from engine.model.loader import read_spec, resolve_max_model_len
from serve_app.config import AppArgs
from serve_app.ingress.lora_names import AdapterNames
from serve_app.observability.telemetry import IngressMetrics
from serve_app.observability.trace_recorder import TraceRecorder
from serve_app.openai.completions import CompletionsService
from serve_app.openai.embeddings import EmbeddingsService
from serve_app.openai.errors import OpenAIError
from serve_app.openai.prompts import PromptBuilder
from serve_app.openai.request_path import RequestPath
from serve_app.openai.responses.service import ResponsesService
from serve_app.transport.delta_channel import DeltaChannels, channel_name
from serve_app.transport.engine_client import EngineClient

logger = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """One model at an ingress replica."""

    name: str
    args: AppArgs  # `model` the checkpoint's directory on this node
    source: str  # `model` as deploy.yaml declares it
    created: int
    max_model_len: int
    prompts: PromptBuilder
    adapters: AdapterNames
    engine: DeploymentHandle
    controller: DeploymentHandle | None
    path: RequestPath
    completions: CompletionsService
    responses: ResponsesService
    embeddings: EmbeddingsService
    prefill: DeploymentHandle | None = None  # its prefill pool (`disaggregation`)

    @staticmethod
    def started(
        declared: AppArgs,
        engine: DeploymentHandle,
        controller: DeploymentHandle | None,
        lora_board: DeploymentHandle | None,
        response_store: DeploymentHandle | None,
        owner: str,
        metrics: IngressMetrics,
        tracer,
        created: int,
        trace: TraceRecorder | None = None,
        prefill: DeploymentHandle | None = None,
    ) -> ServedModel:
        """`declared`: the model's args as deployed; `owner`: this ingress replica's actor
        (its engine replicas end its requests if it dies); `prefill`: the model's prefill
        pool (`disaggregation`)."""
        args = declared.with_local_model(weights=False)  # its tokenizer, not the weights
        name = args.model_name
        # The engines resolve `auto` the same way, from the same config.json.
        spec = read_spec(args.model)
        max_model_len = resolve_max_model_len(args.engine.max_model_len, spec)
        prompts = PromptBuilder(args.model)
        lora = LoRAConfig(**args.engine.lora.model_dump())
        adapters = AdapterNames(name, lora, spec, lora_board)
        channels: DeltaChannels | None = None
        if args.delta_channels:
            channel_id = channel_name(owner, uuid.uuid4().hex[:8])
            channels = DeltaChannels(
                engine, channel_id, args.api.max_unsent_tokens, links=args.delta_links
            )
        model_metrics = metrics.model(name)
        client = EngineClient(
            engine,
            owner,
            channels,
            args.retry_after_s,
            args.request_timeout_s,
            model_metrics.sequence_resumed,
            prefill,
        )
        metrics.watch_path(client)
        path = RequestPath(
            args, max_model_len, prompts, adapters, client, model_metrics, tracer, trace
        )
        if path.defaults:
            logger.info(
                "%s: requests leaving these out sample with its generation_config.json's: %s",
                name,
                path.defaults,
            )
        return ServedModel(
            name,
            args,
            declared.model or "",
            created,
            max_model_len,
            prompts,
            adapters,
            engine,
            controller,
            path,
            CompletionsService(path),
            ResponsesService(path, response_store),
            EmbeddingsService(path),
            prefill,
        )

    def card(self) -> dict[str, Any]:
        card = {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "dynabatch",
            "root": self.source,
            "max_model_len": self.max_model_len,
        }
        if self.path.defaults:  # engine.generation_config auto: the checkpoint's
            card["generation_defaults"] = self.path.defaults
        emulated = self.args.emulated_label()
        if emulated is not None:  # never mistaken for the model
            card["emulated"] = f"{emulated}: no model, a fixed text at its step times"
        return card

    async def cards(self) -> list[dict[str, Any]]:
        """The model's card, then each LoRA adapter's (its `parent` the model, as vLLM lists
        them)."""
        base = self.card()
        adapters = await self.adapters.listed()
        return [base] + [
            base | {"id": name, "root": path, "parent": self.name}
            for name, path in adapters.items()
        ]


class ServedModels:
    def __init__(self, models: list[ServedModel]) -> None:
        self.all = models
        self.first = models[0]
        self._by_name = {served.name: served for served in models}

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    async def pick(self, model: str | None) -> ServedModel:
        """The model a request's `model` names: a served name, `name:adapter`, or an
        adapter's own name; None (where the field is optional): the first. Else a 404
        naming it. With one model, that model: its own adapters' check names an unknown
        one."""
        if model is None or len(self.all) == 1:
            return self.first
        found = self._by_name.get(model) or self._by_name.get(model.rpartition(":")[0])
        if found is not None:
            return found
        for served in self.all:
            if await served.adapters.serves(model):
                return served
        raise OpenAIError.model_not_found(model, self.names)

    def for_adapters(self, model: str | None) -> ServedModel:
        """The model whose adapters a load or unload names: `model` where given, else the
        only model that takes adapters (400 where several do)."""
        if model is not None:
            found = self._by_name.get(model)
            if found is None:
                raise OpenAIError.model_not_found(model, self.names)
            return found
        taking = [served for served in self.all if served.args.engine.lora.enabled]
        if len(taking) > 1:
            message = "model: required where several models take LoRA adapters"
            raise OpenAIError(400, message, param="model")
        return taking[0] if taking else self.first
