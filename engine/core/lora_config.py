"""LoRA adapters' knobs (pure Python; part of engine/core/config.py's records)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.errors import InvalidParam

MAX_LORA_RANK = 512


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (PEFT's format) on the base model, many in one batch."""

    enabled: bool = field(
        default=False,
        metadata={
            "doc": "Serve LoRA adapters: requests name one by `model` ('base:adapter' or the "
            "adapter's name); each step applies each row's adapter to its own tokens."
        },
    )
    adapters: dict[str, str] = field(
        default_factory=dict,
        metadata={
            "doc": "Adapters served from the start: name -> PEFT adapter directory, Hub id or "
            "bucket URI (fetched as `model` is: docs/models.md)."
        },
    )
    search_path: str | None = field(
        default=None,
        metadata={
            "doc": "A directory whose subdirectories are adapters, served by their directory "
            "names and loaded at the first request that names one. Null: none."
        },
    )
    max_loras: int = field(
        default=4,
        metadata={
            "doc": "Adapters one step can run (device slots). A request whose adapter finds no "
            "free slot, and none held only by idle adapters (evicted least recently used "
            "first), waits while others go ahead."
        },
    )
    max_lora_rank: int = field(
        default=16, metadata={"doc": f"Largest adapter rank served (1 to {MAX_LORA_RANK})."}
    )
    max_cpu_loras: int = field(
        default=32,
        metadata={
            "doc": "Adapters kept loaded in host memory (least recently used out first); at "
            "least max_loras."
        },
    )

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, rule: str, value: object) -> None:
            if not ok:
                raise InvalidParam(f"lora.{param}", f"lora.{param} must be {rule}, got {value!r}")

        check(self.max_loras >= 1, "max_loras", ">= 1", self.max_loras)
        rank = self.max_lora_rank
        check(1 <= rank <= MAX_LORA_RANK, "max_lora_rank", f"in [1, {MAX_LORA_RANK}]", rank)
        cpu = self.max_cpu_loras
        check(cpu >= self.max_loras, "max_cpu_loras", ">= max_loras", cpu)
        for name in self.adapters:
            ok = bool(name) and ":" not in name and "/" not in name
            check(ok, "adapters", "named without ':' or '/'", name)
