"""The decoder's linear layers and the checkpoint layers each one holds (pure Python)."""

from __future__ import annotations

# decoder submodule of a layer -> (the checkpoint's layers fused into it, in row order;
# column-parallel under tensor parallelism: its output rows split across ranks, else its
# input columns)
LINEARS: dict[str, tuple[tuple[str, ...], bool]] = {
    "self_attn.qkv_proj": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), True),
    "self_attn.o_proj": (("self_attn.o_proj",), False),
    "mlp.gate_up_proj": (("mlp.gate_proj", "mlp.up_proj"), True),
    "mlp.down_proj": (("mlp.down_proj",), False),
}
