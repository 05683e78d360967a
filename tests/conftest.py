"""Shared fixtures: offline tiny checkpoints (built once, kept under models/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.tiny_model import make_model

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start a Ray cluster of their own run first: before the session's shared
    Serve apps start, whose replicas, controllers and boards would take the host's two cores
    from them all the while (a multinode harness took several times as long beside them)."""
    items.sort(key=lambda item: item.get_closest_marker("own_cluster") is None)


def tiny_model_dir(arch: str = "llama") -> str:
    name = "tiny" if arch == "llama" else f"tiny-{arch}"
    return str(make_model(REPO / "models" / name, size="tiny", arch=arch))


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return tiny_model_dir("llama")


def build_engine(
    model: str,
    block_size: int = 4,
    num_blocks: int = 300,
    enable_prefix_caching: bool = True,
    num_host_blocks: int | None = None,
    device: str = "cpu",
    attention_backend: str = "auto",
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    expert_parallel: bool = False,
    deferred_steps: bool | str = False,
    overlap_steps: bool = True,
    enforce_eager: bool = False,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    calculate_kv_scales: bool = False,
    speculative: dict | None = None,
    lora: dict | None = None,
    **scheduler,
):
    """An LLMEngine with an explicit small cache; `scheduler` holds SchedulerConfig fields.
    `deferred_steps`: steps stay in flight until collected, as a GPU's: True computes them
    then, "at_launch" at launch (tests/engine/deferred_runner.py). `speculative`: the
    SpeculativeConfig's fields (speculation on); `lora`: the LoRAConfig's (LoRA on)."""
    from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from engine.core.lora_config import LoRAConfig
    from engine.llm_engine import LLMEngine
    from tests.engine.deferred_runner import DeferredRunner, InFlightRunner

    config = EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        attention_backend=attention_backend,
        tensor_parallel_size=tensor_parallel_size,
        expert_parallel=expert_parallel,
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
        ),
        scheduler=SchedulerConfig(**scheduler),
        overlap_steps=overlap_steps,
        enforce_eager=enforce_eager,
        quantization=quantization,
        speculative=SpeculativeConfig(**{"enabled": True, **speculative})
        if speculative is not None
        else SpeculativeConfig(),
        lora=LoRAConfig(**{"enabled": True, **lora}) if lora is not None else LoRAConfig(),
    )
    runners = {True: DeferredRunner, "at_launch": InFlightRunner}
    runner = runners[deferred_steps](config) if deferred_steps else None
    return LLMEngine(config, runner=runner)


# One local Ray + Serve for the whole session, shared by tests/serve and tests/chaos.
from tests.local_serve import emulated_app, serve_cluster  # noqa: E402, F401
