"""deploy.yaml's `engine:` section: every knob of the engine's core records but the model,
flat, under the same name, with the same default and description (engine/core/config.py
defines each once); speculative decoding's and LoRA adapters' knobs are blocks of their
own, `speculative:` and `lora:`."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core.lora_config import LoRAConfig

_ENGINE_RECORDS = (EngineConfig, CacheConfig, SchedulerConfig)
_NOT_ENGINE_ARGS = {"model", "cache", "scheduler", "speculative", "lora"}


def _fields_of(*records: type, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for record in records:
        hints = typing.get_type_hints(record)
        for f in dataclasses.fields(record):
            if f.name in skip:
                continue
            doc = f.metadata["doc"]
            if f.default_factory is not dataclasses.MISSING:
                fields[f.name] = (
                    hints[f.name],
                    Field(default_factory=f.default_factory, description=doc),
                )
            else:
                fields[f.name] = (hints[f.name], Field(f.default, description=doc))
    return fields


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


SpeculativeArgs = create_model(
    "SpeculativeArgs",
    __base__=_Strict,
    __doc__=SpeculativeConfig.__doc__,
    **_fields_of(SpeculativeConfig),
)

LoRAArgs = create_model(
    "LoRAArgs", __base__=_Strict, __doc__=LoRAConfig.__doc__, **_fields_of(LoRAConfig)
)


def _engine_fields() -> dict[str, Any]:
    fields = _fields_of(*_ENGINE_RECORDS, skip=frozenset(_NOT_ENGINE_ARGS))
    fields["speculative"] = (
        SpeculativeArgs,
        Field(default_factory=SpeculativeArgs, description=SpeculativeConfig.__doc__),
    )
    fields["lora"] = (
        LoRAArgs,
        Field(default_factory=LoRAArgs, description=LoRAConfig.__doc__),
    )
    return fields


class _EngineArgsBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    """Settings of the engine inside every engine replica (engine/core/config.py)."""

    def engine_config(self, model: str) -> EngineConfig:
        """The core records; raises InvalidParam (a ValueError) naming a bad knob."""
        values = self.model_dump()

        def take(record: type) -> dict[str, Any]:
            names = {f.name for f in dataclasses.fields(record)} - _NOT_ENGINE_ARGS
            return {name: values[name] for name in names}

        return EngineConfig(
            model=model,
            cache=CacheConfig(**take(CacheConfig)),
            scheduler=SchedulerConfig(**take(SchedulerConfig)),
            speculative=SpeculativeConfig(**values["speculative"]),
            lora=LoRAConfig(**values["lora"]),
            **take(EngineConfig),
        )

    @model_validator(mode="after")
    def _validate_in_core(self) -> _EngineArgsBase:
        self.engine_config(model="")  # the one validation of each knob
        return self


EngineArgs = create_model(
    "EngineArgs", __base__=_EngineArgsBase, __doc__=_EngineArgsBase.__doc__, **_engine_fields()
)
