"""Build the decoder straight on its device, in its dtype, from a checkpoint directory.

The module is made on the meta device (no memory), then given uninitialised memory on the
target device in the target dtype, then filled tensor by tensor from the safetensors files:
q/k/v into row slices of the fused qkv weight, gate/up into the fused gate_up weight. Host
memory while loading is the weights themselves on a CPU target (read into place), and one
staging buffer of the largest tensor otherwise. A mixture of experts' per-expert weights go
into their rows of the stacked expert tensors; gpt-oss's stacked ones are read transposed,
or, in MXFP4, dequantized expert by expert.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

import torch

from engine.core.errors import InvalidParam
from engine.model.checkpoint_reader import CheckpointReader, read_index
from engine.model.decoder import Decoder
from engine.model.linear_layers import LINEARS, part_sizes
from engine.model.loader import DecoderSpec, check_model_dir
from engine.model.moe_config import expert_weight_names
from engine.model.rope import RotaryEmbedding
from engine.model.sharding import Shard, SliceOf, checkpoint_slices, shard_spec
from engine.model.sparse_moe import SparseMoE
from engine.quant.kv_scales import set_kv_scales
from engine.quant.linear import QuantizedLinear
from engine.quant.loading import load_quantized, quantize_modules
from engine.quant.mxfp4 import dequantize_mxfp4
from engine.quant.scheme import QuantScheme, online_fp8

if TYPE_CHECKING:
    from engine.model.collectives import TensorParallel


def load_decoder(
    model: str,
    spec: DecoderSpec,
    device: torch.device,
    dtype: torch.dtype,
    native_ops: bool = True,
    max_positions: int | None = None,
    tp: TensorParallel | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
) -> Decoder:
    """The checkpoint's decoder on `device` in `dtype`, in eval mode; with `tp`, this rank's
    shard of it, reading only its slices of the checkpoint (`loaded_bytes` says how much was
    read). A quantized checkpoint's linear layers (or, with `quantization="fp8"`, a float
    checkpoint's, quantized while loading) are QuantizedLinear. Raises ValueError naming a
    weight that is missing or misshaped; nothing of a failed load stays referenced. With
    `kv_cache_dtype` fp8_e4m3, each attention layer gets its FP8 cache scales (the
    checkpoint's, else 1.0)."""
    files = sorted(check_model_dir(model).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model!r}")
    positions = max_positions or spec.max_position_embeddings
    full_spec = spec
    slices: dict[str, SliceOf] = {}
    if tp is not None:
        spec = shard_spec(full_spec, tp.shard.world_size, tp.shard.expert_parallel)
        slices = checkpoint_slices(full_spec, tp.shard)
    scheme = _scheme(full_spec, quantization)
    with torch.device("meta"):
        decoder = Decoder(spec, positions, native_ops, tp)
    decoder = decoder.to(dtype)
    quantized = {}
    if scheme is not None:
        shard = tp.shard if tp is not None else Shard(0, 1)
        quantized = quantize_modules(decoder, full_spec, scheme, shard)
    decoder = decoder.to_empty(device=device)
    if spec.tie_word_embeddings:  # materialising gave the two modules separate tensors
        decoder.lm_head.weight = decoder.embed_tokens.weight
    # Computed tables, not weights: built again off the meta device.
    rope = RotaryEmbedding(spec.head_dim, positions, spec.rope_theta, spec.rope_scaling)
    decoder.rope = rope.to(device=device, dtype=dtype)
    targets = checkpoint_targets(decoder, spec)
    reader = CheckpointReader(read_index(files), device)
    try:
        missing = sorted(set(targets) - set(reader.entries))
        if missing:
            raise ValueError(f"model: checkpoint has no weight {missing[0]!r}")
        with torch.no_grad():
            for name, dest in targets.items():
                reader.copy_into(name, dest, slices.get(name))
            if spec.moe is not None and spec.moe.mxfp4:
                _read_mxfp4_experts(reader, decoder)
            if scheme is not None:
                load_quantized(reader, quantized, scheme, _max_over_ranks(tp))
            if kv_cache_dtype == "fp8_e4m3":
                set_kv_scales(decoder, reader, device)
    except BaseException as exc:
        # The traceback keeps its frames' locals (the half-loaded layers) as long as the error
        # lives: drop this frame's and clear the finished frames below it.
        decoder = quantized = targets = None
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        reader.close()
    if tp is not None and tp.shard.rank and spec.o_proj_bias:
        # o_proj is row-parallel: the ranks' outputs are summed, and its bias counted once.
        for layer in decoder.layers:
            layer.self_attn.o_proj.bias.data.zero_()
    decoder.loaded_bytes = reader.bytes_read
    return decoder.eval()


def _scheme(spec: DecoderSpec, quantization: str | None) -> QuantScheme | None:
    gpt_oss = spec.moe is not None and spec.moe.gpt_oss_experts
    if gpt_oss and (quantization or spec.quantization):
        raise InvalidParam(
            "quantization",
            "quantization: gpt-oss is served from its float or MXFP4 checkpoints, dequantized "
            "(quantization null)",
        )
    if quantization is None:
        return spec.quantization
    if spec.quantization is not None:
        raise InvalidParam(
            "quantization",
            f"quantization: {quantization!r} quantizes a float checkpoint while loading, but "
            f"this checkpoint is already quantized ({spec.quantization.method}); leave it null",
        )
    return online_fp8()


def _max_over_ranks(tp: TensorParallel | None):
    if tp is None or not hasattr(tp, "all_reduce"):  # loaded alone (tests read one shard)
        return None
    return lambda t: tp.all_reduce(t, torch.distributed.ReduceOp.MAX)


def checkpoint_targets(decoder: Decoder, spec: DecoderSpec) -> dict[str, torch.Tensor]:
    """HF weight name -> the tensor (or row slice of a fused tensor) it is read into.
    Quantized layers' weights are not listed (engine/quant/loading.py reads them); their
    biases are."""
    targets: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(decoder.layers):
        src = f"model.layers.{i}."
        if isinstance(layer.mlp, SparseMoE):
            targets |= _expert_targets(layer.mlp, i, spec.architecture)
        for module, (parts, _) in LINEARS.items():
            if isinstance(layer.mlp, SparseMoE) and module.startswith("mlp."):
                continue
            linear = layer.get_submodule(module)
            kinds = ["bias"] if linear.bias is not None else []
            if not isinstance(linear, QuantizedLinear):
                kinds.append("weight")
            for kind in kinds:
                fused = getattr(linear, kind).data
                rows = _row_slices(*part_sizes(spec, module)[0])
                for part, part_rows in zip(parts, rows, strict=True):
                    targets[f"{src}{part}.{kind}"] = fused[part_rows]
        attn = layer.self_attn
        if attn.sinks is not None:
            targets[f"{src}self_attn.sinks"] = attn.sinks.data
        if spec.qk_norm:
            targets[f"{src}self_attn.q_norm.weight"] = attn.q_norm.weight.data
            targets[f"{src}self_attn.k_norm.weight"] = attn.k_norm.weight.data
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{src}{norm}.weight"] = getattr(layer, norm).weight.data
    targets["model.embed_tokens.weight"] = decoder.embed_tokens.weight.data
    targets["model.norm.weight"] = decoder.norm.weight.data
    if not spec.tie_word_embeddings:
        targets["lm_head.weight"] = decoder.lm_head.weight.data
    return targets


def _expert_targets(moe: SparseMoE, layer: int, architecture: str) -> dict[str, torch.Tensor]:
    """A mixture-of-experts layer's checkpoint weights: the router, each expert's gate, up and
    down projections (into its rows of the stacked w13 and w2; under expert parallelism only
    the experts this rank holds), Qwen2-MoE's shared expert and its gate. Quantized experts
    (and a quantized shared expert) are read by engine/quant/loading.py."""
    if moe.b13 is not None:
        return _stacked_expert_targets(moe, layer)
    prefix, (gate, up, down) = expert_weight_names(architecture, layer)
    inter = moe.moe.expert_intermediate_size
    targets = {f"{prefix}gate.weight": moe.gate.weight.data}
    if moe.w13 is not None and moe.w2 is not None:
        for held in range(moe.moe.held):
            expert = f"{prefix}experts.{moe.first_expert + held}."
            targets[f"{expert}{gate}.weight"] = moe.w13.data[held, :inter]
            targets[f"{expert}{up}.weight"] = moe.w13.data[held, inter:]
            targets[f"{expert}{down}.weight"] = moe.w2.data[held]
    if moe.shared_expert is not None:
        assert moe.shared_expert_gate is not None
        shared = f"{prefix}shared_expert."
        targets[f"{prefix}shared_expert_gate.weight"] = moe.shared_expert_gate.weight.data
        fused = moe.shared_expert.gate_up_proj
        if not isinstance(fused, QuantizedLinear):
            half = fused.weight.shape[0] // 2
            targets[f"{shared}gate_proj.weight"] = fused.weight.data[:half]
            targets[f"{shared}up_proj.weight"] = fused.weight.data[half:]
        if not isinstance(moe.shared_expert.down_proj, QuantizedLinear):
            targets[f"{shared}down_proj.weight"] = moe.shared_expert.down_proj.weight.data
    return targets


def _stacked_expert_targets(moe: SparseMoE, layer: int) -> dict[str, torch.Tensor]:
    """gpt-oss's experts, stacked in the checkpoint: gate_up_proj [E, H, 2I] (gate and up
    columns interleaved) and down_proj [E, I, H], each the transpose of ours, and their
    biases; its router `router`, biased. (Under expert parallelism the loader's slices pick
    this rank's experts.)"""
    assert moe.b13 is not None and moe.b2 is not None and moe.gate.bias is not None
    prefix = f"model.layers.{layer}.mlp."
    targets = {
        f"{prefix}router.weight": moe.gate.weight.data,
        f"{prefix}router.bias": moe.gate.bias.data,
        f"{prefix}experts.gate_up_proj_bias": moe.b13.data,
        f"{prefix}experts.down_proj_bias": moe.b2.data,
    }
    if not moe.moe.mxfp4:  # (MXFP4 weights: `_read_mxfp4_experts`)
        targets[f"{prefix}experts.gate_up_proj"] = moe.w13.data.transpose(1, 2)
        targets[f"{prefix}experts.down_proj"] = moe.w2.data.transpose(1, 2)
    return targets


def _read_mxfp4_experts(reader: CheckpointReader, decoder: Decoder) -> None:
    """gpt-oss's MXFP4 experts, dequantized expert by expert (host memory: one expert's
    weights): `<name>_blocks` and `<name>_scales` of gate_up_proj [E, 2I, H] and down_proj
    [E, H, I], in our layout as they are (the checkpoint's MXFP4 tensors are not
    transposed)."""
    for i, layer in enumerate(decoder.layers):
        moe = layer.mlp
        if not (isinstance(moe, SparseMoE) and moe.moe.mxfp4):
            continue
        for name, stacked in (("gate_up_proj", moe.w13), ("down_proj", moe.w2)):
            src = f"model.layers.{i}.mlp.experts.{name}"
            for part in ("_blocks", "_scales"):
                if src + part not in reader.entries:
                    raise ValueError(f"model: checkpoint has no weight {src + part!r}")
            for held in range(moe.moe.held):
                expert = SliceOf(0, moe.first_expert + held, 1, moe.moe.num_experts)
                blocks = reader.read(src + "_blocks", expert)
                scales = reader.read(src + "_scales", expert)
                weights = dequantize_mxfp4(blocks, scales)[0]
                if weights.shape != stacked.shape[1:]:
                    raise ValueError(
                        f"model: weight {src} holds {tuple(weights.shape)} per expert, "
                        f"expected {tuple(stacked.shape[1:])}"
                    )
                stacked.data[held].copy_(weights)


def _row_slices(*sizes: int) -> list[slice]:
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]
