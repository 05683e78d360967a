"""Random LoRA adapters of a base checkpoint, in PEFT's format, written offline for tests,
benchmarks and examples (B is random too, unlike a freshly initialised PEFT adapter, so the
adapter changes the model's output).

    python -m engine.lora.random_adapter --base models/tiny --out DIR [--rank 8]
        [--targets q_proj,v_proj] [--seed 0] [--rslora]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora.adapter import CONFIG_FILE, TARGETS, WEIGHTS_FILE, module_shape
from engine.model.loader import read_spec


def write_random_adapter(
    base: str | Path,
    out: str | Path,
    rank: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
    alpha: float | None = None,
    rslora: bool = False,
    std: float = 0.1,
) -> Path:
    """Write an adapter of `base` (targets: PEFT's short module names) into `out`."""
    spec = read_spec(str(base))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for target in targets:
            module = TARGETS[target]
            rows, cols = module_shape(spec, module)
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, cols, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * std
    save_file(tensors, str(out / WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha if alpha is not None else rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rslora", action="store_true")
    args = parser.parse_args()
    targets = tuple(args.targets.split(","))
    path = write_random_adapter(
        args.base, args.out, args.rank, targets, args.seed, None, args.rslora
    )
    print(f"wrote a rank-{args.rank} LoRA adapter of {args.base} to {path}")


if __name__ == "__main__":
    main()
