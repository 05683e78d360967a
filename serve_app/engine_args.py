"""deploy.yaml's `engine:` section: every knob of the engine's core records but the model,
flat, under the same name, with the same default and description (engine/core/config.py
defines each once); speculative decoding's, LoRA adapters' and the emulated GPU's knobs are
blocks of their own, `speculative:`, `lora:` and `emulate:`."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from engine.core.config import (
    CacheConfig,
    EmulateConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.core.lora_config import LoRAConfig

_ENGINE_RECORDS = (EngineConfig, CacheConfig, SchedulerConfig)
# Records that are blocks of their own under `engine:`, by field name.
_BLOCKS: dict[str, type] = {
    "speculative": SpeculativeConfig,
    "lora": LoRAConfig,
    "emulate": EmulateConfig,
}
_NOT_ENGINE_ARGS = {"model", "cache", "scheduler", *_BLOCKS}


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


def _block_model(record: type) -> type[BaseModel]:
    model_name = f"{record.__name__.removesuffix('Config')}Args"
    return create_model(model_name, __base__=_Strict, __doc__=record.__doc__, **_fields_of(record))


_BLOCK_ARGS = {name: _block_model(record) for name, record in _BLOCKS.items()}


def _engine_fields() -> dict[str, Any]:
    fields = _fields_of(*_ENGINE_RECORDS, skip=frozenset(_NOT_ENGINE_ARGS))
    for name, args in _BLOCK_ARGS.items():
        fields[name] = (args, Field(default_factory=args, description=_BLOCKS[name].__doc__))
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
            **{name: record(**values[name]) for name, record in _BLOCKS.items()},
            **take(EngineConfig),
        )

    @model_validator(mode="after")
    def _validate_in_core(self) -> _EngineArgsBase:
        self.engine_config(model="")  # the one validation of each knob
        return self


EngineArgs = create_model(
    "EngineArgs", __base__=_EngineArgsBase, __doc__=_EngineArgsBase.__doc__, **_engine_fields()
)
