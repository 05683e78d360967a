"""The decoder's linear layers and the checkpoint layers each one holds (pure Python)."""

from __future__ import annotations

from engine.model.loader import DecoderSpec

# decoder submodule of a layer -> (the checkpoint's layers fused into it, in row order;
# column-parallel under tensor parallelism: its output rows split across ranks, else its
# input columns)
LINEARS: dict[str, tuple[tuple[str, ...], bool]] = {
    "self_attn.qkv_proj": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), True),
    "self_attn.o_proj": (("self_attn.o_proj",), False),
    "mlp.gate_up_proj": (("mlp.gate_proj", "mlp.up_proj"), True),
    "mlp.down_proj": (("mlp.down_proj",), False),
}


def part_sizes(spec: DecoderSpec, module: str) -> tuple[list[int], int]:
    """(output rows of each of `module`'s checkpoint parts, its input columns) in a model of
    shape `spec` (the whole model's, or one tensor-parallel rank's)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    inter, hidden = spec.intermediate_size, spec.hidden_size
    return {
        "self_attn.qkv_proj": ([q, kv, kv], hidden),
        "self_attn.o_proj": ([hidden], q),
        "mlp.gate_up_proj": ([inter, inter], hidden),
        "mlp.down_proj": ([hidden], inter),
    }[module]
