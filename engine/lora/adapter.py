"""A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors), read
and checked against the base model it is served on.

Each adapted linear layer W gets W x + s B A x, with A [r, in], B [out, r] and s = alpha / r
(alpha / sqrt(r) with rslora); B is stored here already scaled by s.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.core.errors import InvalidParam
from engine.model.loader import DecoderSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names (as the base checkpoint names them) that adapters may target.
TARGETS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight"
)


@dataclass
class LoRAAdapter:
    """(layer, checkpoint module such as "self_attn.q_proj") -> (A [r, in], s B [out, r]),
    float32 on the host."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shape(spec: DecoderSpec, module: str) -> tuple[int, int]:
    """(out, in) of a checkpoint module of the whole base model."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }[module]


def read_adapter(path: str | Path, spec: DecoderSpec, max_rank: int) -> LoRAAdapter:
    """Read and check an adapter directory; InvalidParam names the file or field at fault."""
    path = Path(path)
    config = _read_config(path / CONFIG_FILE, max_rank)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(path / WEIGHTS_FILE, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _KEY.fullmatch(key)
                if match is None or match[3] not in TARGETS:
                    raise _bad(
                        "target_modules",
                        f"{WEIGHTS_FILE}: {key} is none of the target_modules served "
                        f"({', '.join(TARGETS)})",
                    )
                layer, module = int(match[1]), f"{match[2]}.{match[3]}"
                parts.setdefault((layer, module), {})[match[4]] = f.get_tensor(key).float()
    except (OSError, SafetensorError) as exc:
        raise _bad(WEIGHTS_FILE, f"{WEIGHTS_FILE}: cannot be read ({exc})") from None
    if not parts:
        raise _bad(WEIGHTS_FILE, f"{WEIGHTS_FILE}: holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        where = f"{WEIGHTS_FILE}: layer {layer} {module}"
        if layer >= spec.num_layers:
            raise _bad("num_hidden_layers", f"{where}: the base model has {spec.num_layers} layers")
        if set(ab) != {"A", "B"}:
            raise _bad(WEIGHTS_FILE, f"{where}: needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        out, inp = module_shape(spec, module)
        if a.shape != (rank, inp) or b.shape != (out, rank):
            raise _bad(
                WEIGHTS_FILE,
                f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the "
                f"base model's {list((out, inp))} at r={rank} (an adapter of another base?)",
            )
        weights[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    return LoRAAdapter(rank, weights)


def _read_config(file: Path, max_rank: int) -> dict:
    if not file.is_file():
        raise _bad(CONFIG_FILE, f"{CONFIG_FILE}: not found in {file.parent}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise _bad(CONFIG_FILE, f"{CONFIG_FILE}: not valid JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise _bad(CONFIG_FILE, f"{CONFIG_FILE}: not a LoRA adapter's (peft_type LORA)")
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise _bad("r", f"{CONFIG_FILE}: r must be an integer in [1, {max_rank}], got {rank!r}")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise _bad(flag, f"{CONFIG_FILE}: {flag} adapters are not supported")
    for table in ("rank_pattern", "alpha_pattern"):
        if config.get(table):
            raise _bad(table, f"{CONFIG_FILE}: per-module {table} is not supported")
    if config.get("bias", "none") != "none":
        raise _bad("bias", f"{CONFIG_FILE}: bias must be 'none'")
    if config.get("modules_to_save"):
        raise _bad("modules_to_save", f"{CONFIG_FILE}: modules_to_save is not supported")
    return config


def _bad(param: str, message: str) -> InvalidParam:
    return InvalidParam(param, message)
