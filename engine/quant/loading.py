"""Quantized linear layers in a decoder: which modules they replace (attention's, the dense
MLPs', and a mixture of experts' shared expert and experts, one gate/up and one down per
expert), and how each checkpoint format's tensors (or one tensor-parallel rank's slices of
them) fill their layout (engine/quant/linear.py).

A fused layer (qkv, gate_up) is filled part by part: each part's rows are read, converted to
our layout on the host and copied into its rows of the fused layer. Column-parallel layers
(qkv, gate_up) split output rows across ranks, row-parallel ones (o_proj, down) input columns;
a split never cuts a quantization group or FP8 block (else InvalidParam naming
tensor_parallel_size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from engine.core.errors import InvalidParam
from engine.model.checkpoint_reader import CheckpointReader
from engine.model.decoder import MLP
from engine.model.linear_layers import LINEARS, part_sizes
from engine.model.loader import DecoderSpec
from engine.model.moe_config import expert_weight_names
from engine.model.sharding import Shard, SliceOf
from engine.model.sparse_moe import SparseMoE
from engine.quant.fp8 import FP8, quantize_rows
from engine.quant.linear import QuantizedLinear
from engine.quant.packing import AWQ_ORDER, pack_columns, unpack_columns, unpack_rows
from engine.quant.scheme import QuantScheme


@dataclass(frozen=True)
class LinearPart:
    """One checkpoint linear layer (or this rank's share of it) inside a decoder layer."""

    name: str  # HF module name, e.g. "model.layers.0.self_attn.q_proj"
    rows: slice  # its rows in the (fused) destination layer
    n: int  # the checkpoint's output rows
    k: int  # the checkpoint's input columns
    column: bool
    shard: Shard

    def share(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's share of `size` entries split across the ranks."""
        length = size // self.shard.world_size
        return self.shard.rank * length, length


@dataclass(frozen=True)
class _Linear:
    """A linear layer of a decoder layer, as the checkpoint holds it."""

    module: str  # the decoder layer's submodule, e.g. "self_attn.qkv_proj"
    names: list[str]  # the checkpoint layers fused into it, in row order (HF module names)
    sizes: list[int]  # their output rows (the whole model's)
    k: int  # their input columns (the whole model's)
    column: bool
    shard: Shard  # how it is split over the ranks (experts held whole: one rank's own)


def quantize_modules(
    decoder: nn.Module, full: DecoderSpec, scheme: QuantScheme, shard: Shard
) -> dict[QuantizedLinear, list[LinearPart]]:
    """Replace the decoder's quantized linear layers (on the meta device, after its dtype is
    set) with QuantizedLinear; return each one's checkpoint parts."""
    dtype = decoder.norm.weight.dtype
    layers: dict[QuantizedLinear, list[LinearPart]] = {}
    for i, layer in enumerate(decoder.layers):
        for linear in _linears(layer, full, i, scheme, shard, dtype):
            kept = [scheme.quantizes(name) for name in linear.names]
            if not any(kept):
                continue
            if not all(kept):
                raise InvalidParam(
                    "quantization_config.ignore",
                    f"model: {linear.names} are fused in one layer, but only some are quantized",
                )
            world = linear.shard.world_size
            parts, start = [], 0
            for name, n in zip(linear.names, linear.sizes, strict=True):
                local = n // world if linear.column else n
                rows = slice(start, start + local)
                parts.append(LinearPart(name, rows, n, linear.k, linear.column, linear.shard))
                start += local
            _check_split(scheme, parts)
            k_local = linear.k if linear.column else linear.k // world
            bias = layer.get_submodule(linear.module).bias is not None
            groups = _num_groups(scheme, parts[0])
            with torch.device("meta"):
                new = QuantizedLinear(k_local, start, bias, scheme, dtype, groups)
            layer.set_submodule(linear.module, new)
            layers[new] = parts
    decoder.feature_major_max_tokens = 0  # the native feature-major GEMMs take float weights
    return layers


def _linears(
    layer: nn.Module,
    full: DecoderSpec,
    index: int,
    scheme: QuantScheme,
    shard: Shard,
    dtype: torch.dtype,
) -> list[_Linear]:
    """Layer `index`'s linear layers: attention's, and its dense MLP's or its experts'."""
    src = f"model.layers.{index}."
    linears = []
    for module, (names, column) in LINEARS.items():
        if module.startswith("mlp.") and isinstance(layer.mlp, SparseMoE):
            continue
        sizes, k = part_sizes(full, module)
        linears.append(_Linear(module, [src + name for name in names], sizes, k, column, shard))
    if isinstance(layer.mlp, SparseMoE):
        linears += _expert_linears(layer.mlp, full, index, scheme, shard, dtype)
    return linears


def _expert_linears(
    moe: SparseMoE,
    full: DecoderSpec,
    index: int,
    scheme: QuantScheme,
    shard: Shard,
    dtype: torch.dtype,
) -> list[_Linear]:
    """A sparse layer's linear layers: Qwen2-MoE's shared expert (a dense MLP's), and, where
    the checkpoint's experts are quantized, each held expert's gate/up and down, for which the
    layer takes one MLP module per expert (`SparseMoE.hold_experts`). Under expert
    parallelism a rank holds its experts whole; else a slice of every one, as of a dense
    MLP."""
    assert full.moe is not None
    prefix, (gate, up, down) = expert_weight_names(full.architecture, index)
    hidden, linears = full.hidden_size, []
    if full.moe.shared_expert_intermediate_size:
        inter = full.moe.shared_expert_intermediate_size
        names = ("gate_proj", "up_proj", "down_proj")
        src = prefix + "shared_expert."
        linears += _mlp_linears("mlp.shared_expert.", src, names, inter, hidden, shard)
    experts = [f"{prefix}experts.{moe.first_expert + held}." for held in range(moe.moe.held)]
    kept = [scheme.quantizes(expert + name) for expert in experts for name in (gate, up, down)]
    if not any(kept):
        return linears
    if not all(kept):
        raise InvalidParam(
            "quantization_config.ignore",
            f"model: layer {index}'s experts are only partly quantized (the checkpoint's list "
            "of modules not converted names some of their weights): not served",
        )
    with torch.device("meta"):
        mlps = [MLP(hidden, moe.moe.expert_intermediate_size) for _ in experts]
    moe.hold_experts(nn.ModuleList(mlps).to(dtype))
    whole = Shard(0, 1) if shard.expert_parallel else shard
    inter = full.moe.expert_intermediate_size
    for held, expert in enumerate(experts):
        module = f"mlp.expert_mlps.{held}."
        linears += _mlp_linears(module, expert, (gate, up, down), inter, hidden, whole)
    return linears


def _mlp_linears(
    module: str, src: str, names: tuple[str, str, str], inter: int, hidden: int, shard: Shard
) -> list[_Linear]:
    """A gated MLP's fused gate/up (column-parallel) and its down (row-parallel)."""
    gate, up, down = (src + name for name in names)
    return [
        _Linear(module + "gate_up_proj", [gate, up], [inter, inter], hidden, True, shard),
        _Linear(module + "down_proj", [down], [hidden], inter, False, shard),
    ]


def _group(scheme: QuantScheme, k: int) -> int:
    return scheme.group_size or k


def _num_groups(scheme: QuantScheme, part: LinearPart) -> int:
    if scheme.layout != "int4":
        return 1
    group = _group(scheme, part.k)
    if part.column or part.shard.world_size == 1 or scheme.desc_act:
        return -(-part.k // group)
    return part.share(part.k)[1] // group


def _check_split(scheme: QuantScheme, parts: list[LinearPart]) -> None:
    """A tensor-parallel split (and the fusing of parts) must not cut a group or a block."""
    world = parts[0].shard.world_size
    for part in parts:
        if part.column:
            unit = {"int4": 8, "fp8_block": scheme.block[0], "fp8": 1}[scheme.layout]
            size, what = part.n // world, "output rows"
            cuts = size % unit and (world > 1 or len(parts) > 1)
        else:
            unit = {"int4": _group(scheme, part.k), "fp8_block": scheme.block[1], "fp8": 1}
            unit = unit[scheme.layout]
            if scheme.layout == "int4" and scheme.desc_act:
                unit = 8
            size, what = part.k // world, "input columns"
            cuts = world > 1 and size % unit
        if cuts and world == 1:  # fused with the other parts, a block would straddle two
            raise InvalidParam(
                "model",
                f"model: {part.name} has {size} {what}, not a multiple of its quantization "
                f"unit ({unit}), and is fused with {[p.name for p in parts if p is not part]}: "
                "its blocks are not served",
            )
        if cuts:
            raise InvalidParam(
                "tensor_parallel_size",
                f"model: {part.name} has {size} {what} per rank at tensor_parallel_size "
                f"{world}, not a multiple of its quantization unit ({unit}); "
                "quantization groups and blocks are never split across ranks",
            )


def load_quantized(
    reader: CheckpointReader,
    layers: dict[QuantizedLinear, list[LinearPart]],
    scheme: QuantScheme,
    max_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Fill every quantized layer from the checkpoint (biases are plain targets).
    `max_over_ranks` (online FP8 under tensor parallelism) takes the elementwise max of a
    tensor over the ranks, so a row split across ranks gets the scale of the whole row."""
    fill = {"fp8": _fill_fp8, "fp8_block": _fill_fp8_block, "int4": _fill_int4}[scheme.layout]
    if scheme.method == "online-fp8":
        fill = partial(_fill_online_fp8, max_over_ranks=max_over_ranks)
    for layer, parts in layers.items():
        for part in parts:
            fill(reader, layer, part, scheme)


def _read(
    reader: CheckpointReader,
    name: str,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    piece: SliceOf | None,
) -> torch.Tensor:
    entry = reader.entries.get(name)
    if entry is None:
        raise ValueError(f"model: checkpoint has no weight {name!r}")
    if entry.shape != shape:
        raise ValueError(f"model: weight {name} has shape {entry.shape}, expected {shape}")
    if entry.dtype not in dtypes:
        raise ValueError(
            f"model: weight {name} has dtype {entry.dtype}, expected one of {list(dtypes)}"
        )
    return reader.read(name, piece)


def _split(part: LinearPart, dim: int, size: int, unit: int = 1) -> SliceOf | None:
    """This rank's slice of dimension `dim` (`size` entries of `unit` rows or columns each)
    of a checkpoint tensor, or None when it reads the whole."""
    if part.shard.world_size == 1:
        return None
    start, length = part.share(size)
    return SliceOf(dim, start // unit, length // unit, size // unit)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _fp8_weight(reader: CheckpointReader, part: LinearPart) -> torch.Tensor:
    piece = _split(part, 0 if part.column else 1, part.n if part.column else part.k)
    return _read(reader, part.name + ".weight", (part.n, part.k), (FP8,), piece)


def _fill_fp8(
    reader: CheckpointReader, layer: QuantizedLinear, part: LinearPart, scheme: QuantScheme
) -> None:
    weight = _fp8_weight(reader, part)
    name = f"{part.name}.{scheme.scale_name}"
    entry = reader.entries.get(name)
    if entry is None:
        raise ValueError(f"model: checkpoint has no weight {name!r}")
    per_row = entry.shape not in ((), (1,), (1, 1))
    shape = (part.n, 1) if per_row and len(entry.shape) == 2 else (part.n,)
    piece = _split(part, 0, part.n) if per_row and part.column else None
    scale = _read(reader, name, shape if per_row else entry.shape, _FLOATS, piece)
    rows = weight.shape[0]
    layer.weight[part.rows].copy_(weight)
    layer.weight_scale[part.rows].copy_(scale.float().reshape(-1).expand(rows))


def _fill_fp8_block(
    reader: CheckpointReader, layer: QuantizedLinear, part: LinearPart, scheme: QuantScheme
) -> None:
    weight = _fp8_weight(reader, part)
    bn, bk = scheme.block
    shape = (-(-part.n // bn), -(-part.k // bk))
    piece = _split(part, 0, part.n, bn) if part.column else _split(part, 1, part.k, bk)
    scale = _read(reader, f"{part.name}.{scheme.scale_name}", shape, _FLOATS, piece)
    layer.weight[part.rows].copy_(weight)
    first = part.rows.start // bn
    layer.weight_scale[first : first + scale.shape[0]].copy_(scale.float())


def _fill_online_fp8(
    reader: CheckpointReader,
    layer: QuantizedLinear,
    part: LinearPart,
    scheme: QuantScheme,
    max_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None,
) -> None:
    piece = _split(part, 0 if part.column else 1, part.n if part.column else part.k)
    weight = _read(reader, part.name + ".weight", (part.n, part.k), _FLOATS, piece)
    # Quantized where the layer lives: one part in float at a time, on top of FP8 weights.
    weight = weight.to(layer.weight.device)
    amax = weight.abs().amax(dim=1).float()
    if piece is not None and not part.column and max_over_ranks is not None:
        amax = max_over_ranks(amax)  # the same scales as one rank's whole rows
    q, scale = quantize_rows(weight, amax)
    layer.weight[part.rows].copy_(q)
    layer.weight_scale[part.rows].copy_(scale)


def _fill_int4(
    reader: CheckpointReader, layer: QuantizedLinear, part: LinearPart, scheme: QuantScheme
) -> None:
    n, k, name = part.n, part.k, part.name
    group = _group(scheme, k)
    groups = -(-k // group)
    # Group-dimension slices: row-parallel shards take their groups, unless act-order groups
    # are scattered over every rank's columns.
    whole_groups = part.column or scheme.desc_act
    g_piece = None if whole_groups else _split(part, 0, k, group)
    i32 = (torch.int32,)
    if scheme.packing == "awq":
        w_piece = _split(part, 1, n, 8) if part.column else _split(part, 0, k)
        qweight = _read(reader, name + ".qweight", (k, n // 8), i32, w_piece)
        q = unpack_columns(qweight, AWQ_ORDER)  # [k, n]
        zero_order = AWQ_ORDER
    else:
        w_piece = _split(part, 1, n) if part.column else _split(part, 0, k, 8)
        qweight = _read(reader, name + ".qweight", (k // 8, n), i32, w_piece)
        q = unpack_rows(qweight)
        zero_order = None
    n_piece = _split(part, 1, n) if part.column else None
    z_piece = _split(part, 1, n, 8) if part.column else g_piece
    s_piece = n_piece if part.column else g_piece
    scales = _read(reader, name + ".scales", (groups, n), _FLOATS, s_piece)
    qzeros = _read(reader, name + ".qzeros", (groups, n // 8), i32, z_piece)
    zeros = unpack_columns(qzeros, zero_order or tuple(range(8)))
    zeros = (zeros.to(torch.int32) + scheme.zero_offset) & 0xF
    k_local = q.shape[0]
    if scheme.desc_act:
        g_piece_k = None if part.column else _split(part, 0, k)
        g_idx = _read(reader, name + ".g_idx", (k,), i32, g_piece_k)
    else:
        g_idx = torch.arange(k_local, dtype=torch.int32) // group
    layer.qweight[part.rows].copy_(pack_columns(q.t().contiguous()))
    layer.scales[part.rows].copy_(scales.t().float())
    layer.zeros[part.rows].copy_(zeros.t().to(torch.uint8))
    if part.rows.start == 0:
        layer.g_idx.copy_(g_idx)
    elif not torch.equal(layer.g_idx.cpu(), g_idx):
        raise ValueError(f"model: {name}.g_idx differs from the g_idx of the layers fused with it")
