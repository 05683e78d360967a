"""One configuration vocabulary: each knob is defined once (engine/core/config.py for the
engine), deploy.yaml uses the documented defaults unless it says why, and no other module
declares a second default for an engine knob."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pydantic import BaseModel

from engine.core.config import (
    CacheConfig,
    EmulateConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.core.lora_config import LoRAConfig
from serve_app.config import AppArgs, EngineArgs
from tests.conftest import REPO
from tests.local_serve import deploy_yaml_args

ENGINE_RECORDS = (EngineConfig, CacheConfig, SchedulerConfig)
# engine: blocks of their own
BLOCKS = {"speculative": SpeculativeConfig, "lora": LoRAConfig, "emulate": EmulateConfig}


def engine_knobs() -> dict[str, dataclasses.Field]:
    return {
        f.name: f
        for record in ENGINE_RECORDS
        for f in dataclasses.fields(record)
        if f.name not in ("model", "cache", "scheduler", *BLOCKS)
    }


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_engine_args_carry_each_core_knob_with_its_default_and_description():
    knobs = engine_knobs()
    assert set(EngineArgs.model_fields) == set(knobs) | set(BLOCKS)
    fields = [(EngineArgs, knobs, n) for n in knobs]
    for name, record in BLOCKS.items():
        block = EngineArgs.model_fields[name].annotation
        block_knobs = {f.name: f for f in dataclasses.fields(record)}
        assert set(block.model_fields) == set(block_knobs)
        fields += [(block, block_knobs, n) for n in block_knobs]
    for model, record_fields, name in fields:
        info = model.model_fields[name]
        assert info.get_default(call_default_factory=True) == _default(record_fields[name]), name
        assert info.description == record_fields[name].metadata["doc"], name


def _differences(model: type[BaseModel], values: dict, defaults: BaseModel | None) -> list[str]:
    """Keys of `values` (nested dicts of `model`) that differ from the defaults: the fields'
    own, or those of `defaults` where the parent's default is an instance."""
    out = []
    for name, value in values.items():
        info = model.model_fields[name]
        default = (
            getattr(defaults, name)
            if defaults is not None
            else info.get_default(call_default_factory=True)
        )
        kinds = getattr(info.annotation, "__args__", (info.annotation,))  # X | None
        sub = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if isinstance(value, dict) and sub is not None:
            inner = default if isinstance(default, BaseModel) else None
            out += [f"{name}.{key}" for key in _differences(sub, value, inner)]
        elif value != default:
            out.append(name)
    return out


def test_deploy_yaml_uses_the_defaults_unless_it_says_why():
    """A value that differs from its field's default has a comment on its line or on the
    comment lines right above it."""
    args = deploy_yaml_args()
    lines = (REPO / "deploy.yaml").read_text().splitlines()
    differing = _differences(AppArgs, {k: v for k, v in args.items() if k != "model"}, None)
    for key in differing:
        leaf = key.rsplit(".", 1)[-1]
        at = next(i for i, line in enumerate(lines) if re.match(rf"\s+{leaf}:", line))
        above = at - 1
        commented = "#" in lines[at] or lines[above].lstrip().startswith("#")
        assert commented, f"deploy.yaml: {key} differs from its default without a reason"


def test_no_module_declares_a_second_default_for_an_engine_knob():
    """A class field named after an engine knob with a literal default is a second
    definition (`seed` is also a request's and a workload's own field)."""
    names = "|".join(name for name in engine_knobs() if name != "seed")
    declaration = re.compile(rf"^    ({names})\s*:[^=\n]*=\s*[-\d\"'(]", re.MULTILINE)
    found = []
    for path in sorted(REPO.glob("*/**/*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in ("tests", ".venv", "build") or rel == Path("engine/core/config.py"):
            continue
        found += [f"{rel}: {m.group(1)}" for m in declaration.finditer(path.read_text())]
    assert not found, found


def test_the_configuration_page_is_generated_from_the_current_fields():
    """docs/configuration.md is what `python -m serve_app.config_docs` writes now."""
    from serve_app.config_docs import PAGE, render

    assert PAGE.read_text() == render(), "run `python -m serve_app.config_docs`"
    for name in engine_knobs():
        assert f"| `{name}` |" in PAGE.read_text(), name
