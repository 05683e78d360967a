"""Quantized checkpoints written offline from a float one, in the public formats' layouts and
arithmetic, each with its dequantized twin (the float model the quantized one computes):

    python -m engine.quant.checkpoint_writer --src models/tiny-quant --format awq --out DIR

writes DIR (config.json with the format's quantization_config, the quantized tensors, the
tokenizer) and DIR-dequantized (the same model with float32 weights equal to what the
quantized ones stand for). The decoder layers' linear weights are quantized; embeddings,
norms and the LM head stay float, as the public quantizers leave them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.quant.fp8 import FP8, expand_blocks, quantize_blocks, quantize_rows
from engine.quant.packing import AWQ_ORDER, pack_columns, pack_rows

FORMATS = (
    "ct-fp8-tensor",  # compressed-tensors float-quantized, one scale per tensor
    "ct-fp8-channel",  # compressed-tensors float-quantized, one scale per output channel
    "ct-fp8-block",  # compressed-tensors float-quantized, 128x128 blocks
    "fp8-block",  # quant_method fp8 with weight_block_size (Qwen3-FP8, DeepSeek)
    "awq",  # AutoAWQ GEMM, 4 bits, zero points
    "gptq",  # GPTQ v1, 4 bits, symmetric, desc_act false
    "gptq-asym-actorder",  # GPTQ v1, 4 bits, zero points, desc_act true
    "gptq-v2",  # GPTQ v2 (zero points stored as they are), 4 bits, zero points
    "online-fp8",  # the float checkpoint itself; its twin is what `quantization: fp8` makes
)
# A mixture of experts' routers (and Qwen2-MoE's shared-expert gate) stay float, as the public
# FP8 checkpoints keep them (listed among the modules not converted).
_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.shared_expert_gate.weight")


def _is_linear(name: str, tensor: torch.Tensor) -> bool:
    """Whether `name` is a decoder layer's linear weight that the quantizers convert: the
    attention projections and the MLPs' (a mixture of experts': every expert's and the
    shared expert's)."""
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and not name.endswith(_ROUTERS)
    )


def _fp8_config(fmt: str, routers: list[str]) -> dict:
    if fmt in ("fp8-block", "online-fp8"):
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", *routers],
        }
    strategy = fmt.removeprefix("ct-fp8-")
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy}
    weights |= {"dynamic": False, "group_size": None, "actorder": None, "observer": "minmax"}
    weights["block_structure"] = [128, 128] if strategy == "block" else None
    tokens = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token"}
    tokens |= {"dynamic": True, "group_size": None, "block_structure": None, "actorder": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None if strategy == "block" else tokens,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", *routers],
        "kv_cache_scheme": None,
    }


def _quantize_fp8(fmt: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors by suffix, the dequantized float32 weight)."""
    if fmt in ("fp8-block", "ct-fp8-block"):
        q, scale = quantize_blocks(w, (128, 128))
        name = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
        deq = q.float() * expand_blocks(scale, (128, 128), q.shape)
        return {"weight": q, name: scale}, deq
    if fmt == "online-fp8":
        q, scale = quantize_rows(w)
        return {"weight": w}, q.float() * scale[:, None]
    if fmt == "ct-fp8-tensor":
        scale = (w.float().abs().max() / torch.finfo(FP8).max).reshape(1)
        q = (w.float() / scale).to(FP8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    # Channel scales in bfloat16, as llm-compressor writes them for a bfloat16 model.
    _, scale = quantize_rows(w)
    scale = scale.to(torch.bfloat16)
    q = (w.float() / scale.float()[:, None]).clamp(-448, 448).to(FP8)
    return {"weight": q, "weight_scale": scale[:, None]}, q.float() * scale.float()[:, None]


def _int4_groups(w: torch.Tensor, g_idx: torch.Tensor, num_groups: int, sym: bool):
    """Per (row, group): float16 scales [N, G], zero points [N, G] and codes [N, K]."""
    n = w.shape[0]
    lo = torch.full((n, num_groups), float("inf"))
    hi = torch.full((n, num_groups), float("-inf"))
    idx = g_idx.long()[None, :].expand(n, -1)
    lo = lo.scatter_reduce(1, idx, w.float(), "amin")
    hi = hi.scatter_reduce(1, idx, w.float(), "amax")
    if sym:
        hi = torch.maximum(hi.abs(), lo.abs())
        lo = -hi
    scale = ((hi - lo) / 15).clamp(min=1e-5).to(torch.float16).float()
    zero = torch.full_like(scale, 8.0) if sym else (-lo / scale).round().clamp(0, 15)
    codes = (w.float() / scale[:, g_idx.long()]).round() + zero[:, g_idx.long()]
    return scale, zero.to(torch.uint8), codes.clamp(0, 15).to(torch.uint8)


def _quantize_int4(
    fmt: str, w: torch.Tensor, group: int, perm: torch.Tensor | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    num_groups = -(-k // group)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if perm is not None:  # act order: the i-th column in `perm` order is in group i // group
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
    scale, zero, codes = _int4_groups(w, g_idx, num_groups, sym=fmt == "gptq")
    deq = (codes.float() - zero[:, g_idx.long()].float()) * scale[:, g_idx.long()]
    scales = scale.t().contiguous().to(torch.float16)  # [G, N]
    if fmt == "awq":
        tensors = {
            "qweight": pack_columns(codes.t().contiguous(), AWQ_ORDER),
            "qzeros": pack_columns(zero.t().contiguous(), AWQ_ORDER),
            "scales": scales,
        }
    else:  # GPTQ v1 stores each zero point minus one, v2 as it is
        offset = 0 if fmt == "gptq-v2" else 1
        stored = ((zero.t().to(torch.int32) - offset) & 0xF).to(torch.uint8).contiguous()
        tensors = {
            "qweight": pack_rows(codes.t().contiguous()),
            "qzeros": pack_columns(stored),
            "scales": scales,
            "g_idx": g_idx,
        }
    return tensors, deq


def _int4_config(fmt: str, group: int, routers: list[str]) -> dict:
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": routers or None,
        }
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": fmt == "gptq-asym-actorder",
        "sym": fmt == "gptq",
        "checkpoint_format": "gptq_v2" if fmt == "gptq-v2" else "gptq",
        "static_groups": False,
        "true_sequential": True,
        "damp_percent": 0.01,
        "modules_to_not_convert": routers or None,
    }


def write_quantized(
    src: str | Path, out: str | Path, fmt: str, group_size: int = 128, seed: int = 0
) -> tuple[Path, Path]:
    """Write `src` (a float checkpoint dir) quantized as `fmt` to `out` (a mixture of experts'
    experts too), and its dequantized twin to `out`-dequantized; return both paths (kept if
    already written)."""
    src, out = Path(src), Path(out)
    twin = out.with_name(out.name + "-dequantized")
    if (out / "model.safetensors").exists() and (twin / "model.safetensors").exists():
        return out, twin
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    weights = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    rng = torch.Generator().manual_seed(seed)
    # Act order: one column order per input (q/k/v share theirs, as do gate/up).
    perms: dict[str, torch.Tensor] = {}
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if not _is_linear(name, tensor):
            quantized[name] = dequantized[name] = tensor.float().contiguous()
            continue
        base = name.removesuffix(".weight")
        if fmt.startswith(("ct-", "fp8", "online")):
            parts, deq = _quantize_fp8(fmt, tensor)
        else:
            perm = None
            if fmt == "gptq-asym-actorder":
                row_parallel = base.endswith(("o_proj", "down_proj", ".w2"))
                key = base.rsplit(".", 1)[0] + ("" if row_parallel else "+")
                if key not in perms:
                    perms[key] = torch.randperm(tensor.shape[1], generator=rng)
                perm = perms[key]
            parts, deq = _quantize_int4(fmt, tensor, group_size, perm)
        quantized |= {f"{base}.{suffix}": t.contiguous() for suffix, t in parts.items()}
        dequantized[name] = deq.contiguous()
    is_int4 = fmt.startswith(("awq", "gptq"))
    routers = sorted(n.removesuffix(".weight") for n in weights if n.endswith(_ROUTERS))
    quant = _int4_config(fmt, group_size, routers) if is_int4 else _fp8_config(fmt, routers)
    quantized_config = config if fmt == "online-fp8" else config | {"quantization_config": quant}
    for path, tensors, cfg in (
        (out, quantized, quantized_config),
        (twin, dequantized, config | {"torch_dtype": "float32", "dtype": "float32"}),
    ):
        path.mkdir(parents=True, exist_ok=True)
        for extra in src.iterdir():
            if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
                shutil.copy(extra, path / extra.name)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return out, twin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True)
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    out, twin = write_quantized(args.src, args.out, args.format, args.group_size)
    print(f"wrote {out} and {twin}")


if __name__ == "__main__":
    main()
