"""Shared fixtures: offline tiny checkpoints (built once, kept under models/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.tiny_model import make_model

REPO = Path(__file__).resolve().parent.parent


def tiny_model_dir(arch: str = "llama") -> str:
    name = "tiny" if arch == "llama" else f"tiny-{arch}"
    return str(make_model(REPO / "models" / name, size="tiny", arch=arch))


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return tiny_model_dir("llama")
