"""Build the decoder straight on its device, in its dtype, from a checkpoint directory.

The module is made on the meta device (no memory), then given uninitialised memory on the
target device in the target dtype, then filled tensor by tensor from the safetensors files:
q/k/v into row slices of the fused qkv weight, gate/up into the fused gate_up weight. Host
memory while loading is the weights themselves on a CPU target (read into place), and one
staging buffer of the largest tensor otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.checkpoint_reader import CheckpointReader, read_index
from engine.model.decoder import Decoder
from engine.model.loader import DecoderSpec, check_model_dir
from engine.model.rope import RotaryEmbedding
from engine.model.sharding import SliceOf, checkpoint_slices, shard_spec

if TYPE_CHECKING:
    from engine.runner.tensor_parallel import TensorParallel


def load_decoder(
    model: str,
    spec: DecoderSpec,
    device: torch.device,
    dtype: torch.dtype,
    native_ops: bool = True,
    max_positions: int | None = None,
    tp: TensorParallel | None = None,
) -> Decoder:
    """The checkpoint's decoder on `device` in `dtype`, in eval mode; with `tp`, this rank's
    shard of it, reading only its slices of the checkpoint (`loaded_bytes` says how much was
    read). Raises ValueError naming a weight that is missing or misshaped."""
    files = sorted(check_model_dir(model).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model!r}")
    positions = max_positions or spec.max_position_embeddings
    full_spec = spec
    slices: dict[str, SliceOf] = {}
    if tp is not None:
        spec = shard_spec(full_spec, tp.shard.world_size)
        slices = checkpoint_slices(full_spec, tp.shard)
    with torch.device("meta"):
        decoder = Decoder(spec, positions, native_ops, tp)
    decoder = decoder.to(dtype).to_empty(device=device)
    if spec.tie_word_embeddings:  # materialising gave the two modules separate tensors
        decoder.lm_head.weight = decoder.embed_tokens.weight
    # Computed tables, not weights: built again off the meta device.
    rope = RotaryEmbedding(spec.head_dim, positions, spec.rope_theta, spec.rope_scaling)
    decoder.rope = rope.to(device=device, dtype=dtype)
    targets = checkpoint_targets(decoder, spec)
    reader = CheckpointReader(read_index(files), device)
    missing = sorted(set(targets) - set(reader.entries))
    if missing:
        raise ValueError(f"model: checkpoint has no weight {missing[0]!r}")
    try:
        with torch.no_grad():
            for name, dest in targets.items():
                reader.copy_into(name, dest, slices.get(name))
    finally:
        reader.close()
    decoder.loaded_bytes = reader.bytes_read
    return decoder.eval()


def checkpoint_targets(decoder: Decoder, spec: DecoderSpec) -> dict[str, torch.Tensor]:
    """HF weight name -> the tensor (or row slice of a fused tensor) it is read into."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    inter = spec.intermediate_size
    targets: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(decoder.layers):
        src = f"model.layers.{i}."
        attn = layer.self_attn
        for kind in ("weight", "bias") if spec.attention_bias else ("weight",):
            fused = getattr(attn.qkv_proj, kind).data
            for part, rows in zip("qkv", _row_slices(q, kv, kv), strict=True):
                targets[f"{src}self_attn.{part}_proj.{kind}"] = fused[rows]
        targets[f"{src}self_attn.o_proj.weight"] = attn.o_proj.weight.data
        if spec.qk_norm:
            targets[f"{src}self_attn.q_norm.weight"] = attn.q_norm.weight.data
            targets[f"{src}self_attn.k_norm.weight"] = attn.k_norm.weight.data
        gate_up = layer.mlp.gate_up_proj.weight.data
        for part, rows in zip(("gate", "up"), _row_slices(inter, inter), strict=True):
            targets[f"{src}mlp.{part}_proj.weight"] = gate_up[rows]
        targets[f"{src}mlp.down_proj.weight"] = layer.mlp.down_proj.weight.data
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{src}{norm}.weight"] = getattr(layer, norm).weight.data
    targets["model.embed_tokens.weight"] = decoder.embed_tokens.weight.data
    targets["model.norm.weight"] = decoder.norm.weight.data
    if not spec.tie_word_embeddings:
        targets["lm_head.weight"] = decoder.lm_head.weight.data
    return targets


def _row_slices(*sizes: int) -> list[slice]:
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]
