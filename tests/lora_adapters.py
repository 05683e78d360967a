"""Three random LoRA adapters of a tiny checkpoint (PEFT's format), written once under
models/: different ranks, target modules and scalings."""

from __future__ import annotations

from pathlib import Path

from engine.lora.adapter import CONFIG_FILE
from engine.lora.random_adapter import write_random_adapter

# name: (rank, targets, seed, alpha, rslora)
ADAPTERS = {
    "sql": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 1),
    "chat": (4, ("q_proj", "v_proj"), 2),
    "code": (16, ("o_proj", "gate_proj", "down_proj"), 3),
}


def lora_adapters(base: str) -> dict[str, str]:
    """name -> directory of each adapter of `base` (written if missing)."""
    root = Path(base).parent / f"{Path(base).name}-lora"
    paths = {}
    for name, (rank, targets, seed) in ADAPTERS.items():
        out = root / name
        if not (out / CONFIG_FILE).is_file():
            # chat scales by alpha / sqrt(r) (rslora), code by alpha 8 / r 16.
            alpha = 8 if name == "code" else None
            write_random_adapter(base, out, rank, targets, seed, alpha, rslora=name == "chat")
        paths[name] = str(out)
    return paths
