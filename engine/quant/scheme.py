"""Which quantized format a checkpoint's linear weights are in, read from config.json's
`quantization_config` (pure Python: no torch).

Every format is loaded into one of three layouts (engine/quant/linear.py): FP8 weights with a
scale per output row (compressed-tensors' tensor and channel strategies, vLLM's plain `fp8`,
and online quantization), FP8 weights with a scale per 128x128 block (`quant_method: fp8` with
`weight_block_size`, compressed-tensors' block strategy), and INT4 weights with a scale and a
zero point per group of input columns (AWQ's GEMM packing, GPTQ's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from engine.core.errors import InvalidParam

WeightLayout = Literal["fp8", "fp8_block", "int4"]

SERVED_METHODS = (
    "compressed-tensors (float-quantized FP8: tensor, channel or block weight scales)",
    "fp8 (per-tensor, or weight_block_size)",
    "awq (version gemm, 4 bits, zero_point)",
    "gptq (4 bits; desc_act, sym)",
)


@dataclass(frozen=True)
class QuantScheme:
    """How to read and run one checkpoint's quantized linear layers."""

    method: str  # quant_method as the checkpoint names it ("online-fp8" for ours)
    layout: WeightLayout
    block: tuple[int, int] = (128, 128)  # fp8_block: [output rows, input columns] per scale
    group_size: int = 128  # int4: input columns per scale; 0: one group of every column
    packing: Literal["awq", "gptq", ""] = ""  # int4: the checkpoint's packing
    desc_act: bool = False  # gptq: groups in the order of g_idx, not of the columns
    zero_offset: int = 0  # gptq v1 stores each zero point minus one
    scale_name: str = "weight_scale"  # fp8: the checkpoint's name of the weight scale
    ignore: tuple[str, ...] = field(default=())  # modules left unquantized

    def quantizes(self, module: str) -> bool:
        """Whether `module` (an HF name such as "model.layers.0.self_attn.q_proj") holds
        quantized weights in this checkpoint."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern):
                return False
        return True


def online_fp8() -> QuantScheme:
    """`engine.quantization: fp8`: float weights quantized per output channel at load."""
    return QuantScheme(method="online-fp8", layout="fp8")


def parse_quantization_config(cfg: object) -> QuantScheme:
    """The QuantScheme of a `quantization_config`; raises InvalidParam naming the field (and,
    for an unknown method, listing what we serve)."""
    if not isinstance(cfg, dict):
        raise _unsupported("quantization_config", f"is not an object: {cfg!r}")
    method = cfg.get("quant_method")
    parse = {"compressed-tensors": _compressed_tensors, "fp8": _fp8, "awq": _awq, "gptq": _gptq}
    if method not in parse:
        raise _unsupported("quant_method", f"{method!r} is not served")
    return parse[method](cfg)


def _unsupported(field_name: str, what: str) -> InvalidParam:
    return InvalidParam(
        f"quantization_config.{field_name}",
        f"model: quantization_config.{field_name} {what}; dynabatch serves "
        + "; ".join(SERVED_METHODS),
    )


def _need(ok: bool, field_name: str, rule: str, value: object) -> None:
    if not ok:
        raise _unsupported(field_name, f"must be {rule}, got {value!r}")


def _fp8(cfg: dict) -> QuantScheme:
    _need(cfg.get("fmt", "e4m3") == "e4m3", "fmt", "e4m3", cfg.get("fmt"))
    ignore = tuple(cfg.get("modules_to_not_convert") or ()) + ("lm_head",)
    block = cfg.get("weight_block_size")
    if block is None:
        return QuantScheme(method="fp8", layout="fp8", ignore=ignore)
    ok = isinstance(block, list) and len(block) == 2 and all(b > 0 for b in block)
    _need(ok, "weight_block_size", "[rows, columns]", block)
    return QuantScheme(
        method="fp8",
        layout="fp8_block",
        block=(int(block[0]), int(block[1])),
        scale_name="weight_scale_inv",
        ignore=ignore,
    )


def _compressed_tensors(cfg: dict) -> QuantScheme:
    fmt = cfg.get("format")
    _need(fmt in ("float-quantized", "naive-quantized"), "format", "float-quantized", fmt)
    groups = cfg.get("config_groups") or {}
    _need(len(groups) == 1, "config_groups", "one group", sorted(groups))
    (group,) = groups.values()
    weights = group.get("weights") or {}
    prefix = "config_groups.weights."
    _need(weights.get("type") == "float", prefix + "type", "float", weights.get("type"))
    _need(weights.get("num_bits") == 8, prefix + "num_bits", "8", weights.get("num_bits"))
    _need(weights.get("symmetric", True), prefix + "symmetric", "true", weights.get("symmetric"))
    strategy = weights.get("strategy")
    _need(
        strategy in ("tensor", "channel", "block"),
        prefix + "strategy",
        "tensor, channel or block",
        strategy,
    )
    activations = group.get("input_activations")
    if activations is not None:
        kind = activations.get("type")
        _need(kind == "float", "config_groups.input_activations.type", "float", kind)
    ignore = tuple(cfg.get("ignore") or ())
    if strategy != "block":
        return QuantScheme(method="compressed-tensors", layout="fp8", ignore=ignore)
    block = weights.get("block_structure")
    ok = isinstance(block, list) and len(block) == 2
    _need(ok, prefix + "block_structure", "[rows, columns]", block)
    return QuantScheme(
        method="compressed-tensors", layout="fp8_block", block=tuple(block), ignore=ignore
    )


def _int4_common(cfg: dict) -> int:
    _need(cfg.get("bits", cfg.get("w_bit")) == 4, "bits", "4", cfg.get("bits", cfg.get("w_bit")))
    group = cfg.get("group_size", cfg.get("q_group_size", 128))
    _need(isinstance(group, int) and (group == -1 or group > 0), "group_size", "> 0 or -1", group)
    _need(group == -1 or group % 8 == 0, "group_size", "a multiple of 8", group)
    return 0 if group == -1 else group


def _awq(cfg: dict) -> QuantScheme:
    group = _int4_common(cfg)
    version = str(cfg.get("version", "gemm")).lower()
    _need(version == "gemm", "version", "gemm", cfg.get("version"))
    _need(cfg.get("zero_point", True), "zero_point", "true", cfg.get("zero_point"))
    ignore = tuple(cfg.get("modules_to_not_convert") or ()) + ("lm_head",)
    return QuantScheme(method="awq", layout="int4", group_size=group, packing="awq", ignore=ignore)


def _gptq(cfg: dict) -> QuantScheme:
    group = _int4_common(cfg)
    fmt = cfg.get("checkpoint_format", "gptq")
    _need(fmt in ("gptq", "gptq_v2"), "checkpoint_format", "gptq or gptq_v2", fmt)
    dynamic = cfg.get("dynamic")
    _need(not dynamic, "dynamic", "empty (one scheme for every layer)", dynamic)
    return QuantScheme(
        method="gptq",
        layout="int4",
        group_size=group,
        packing="gptq",
        desc_act=bool(cfg.get("desc_act", False)),
        zero_offset=1 if fmt == "gptq" else 0,
        ignore=tuple(cfg.get("modules_to_not_convert") or ()) + ("lm_head",),
    )
