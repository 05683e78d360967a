"""Tensor parallelism's split of a decoder: what one rank of N holds (pure Python).

Rank r holds heads [r*H/N, (r+1)*H/N) of q and of k/v (column-parallel qkv), the same
columns of o_proj (row-parallel: its output is a partial sum, all-reduced), MLP columns
[r*I/N, (r+1)*I/N) of gate/up and the same rows of down_proj's input (row-parallel), and
vocabulary rows [r*V', (r+1)*V') of the embedding and LM head, V' = ceil(V/N) (the last
rank's rows beyond V are zeros and their logits are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.core.errors import InvalidParam
from engine.model.loader import DecoderSpec
from engine.model.moe_config import expert_weight_names


@dataclass(frozen=True)
class Shard:
    rank: int
    world_size: int
    # Mixtures of experts: each rank holds 1/N of the experts whole (else 1/N of every
    # expert's columns, as of a dense MLP's).
    expert_parallel: bool = False

    def vocab_rows(self, vocab_size: int) -> int:
        """Embedding and LM head rows each rank holds."""
        return -(-vocab_size // self.world_size)

    def vocab_start(self, vocab_size: int) -> int:
        return self.rank * self.vocab_rows(vocab_size)


@dataclass(frozen=True)
class SliceOf:
    """Which part of a checkpoint tensor a rank reads: `length` entries of dimension `dim`
    from `start`, of `full` the checkpoint has (fewer where it ends first: the rest of the
    destination is zeroed)."""

    dim: int
    start: int
    length: int
    full: int


def shard_spec(spec: DecoderSpec, world_size: int, expert_parallel: bool = False) -> DecoderSpec:
    """The shape one rank's decoder has (the vocabulary stays whole: the decoder splits it).
    Raises InvalidParam naming tensor_parallel_size when the model does not divide."""
    moe = spec.moe
    dims = [
        ("num_attention_heads", spec.num_heads),
        ("num_key_value_heads", spec.num_kv_heads),
        ("intermediate_size", spec.intermediate_size),
    ]
    if moe is not None:
        experts = ("num_experts", moe.num_experts)
        columns = ("moe_intermediate_size", moe.expert_intermediate_size)
        dims.append(experts if expert_parallel else columns)
        dims.append(("shared_expert_intermediate_size", moe.shared_expert_intermediate_size))
    if moe is not None and moe.gpt_oss_experts and not expert_parallel and world_size > 1:
        raise InvalidParam(
            "expert_parallel",
            "expert_parallel: gpt-oss's experts are split whole over the tensor-parallel ranks "
            "(expert_parallel: true), not by columns",
        )
    for field, value in dims:
        if value % world_size:
            raise InvalidParam(
                "tensor_parallel_size",
                f"tensor_parallel_size ({world_size}) must divide the model's {field} ({value})",
            )
    if moe is not None:  # the shared expert split as a dense MLP either way
        moe = replace(
            moe, shared_expert_intermediate_size=moe.shared_expert_intermediate_size // world_size
        )
    if moe is not None and expert_parallel:
        moe = replace(moe, experts_held=moe.num_experts // world_size)
    elif moe is not None:
        moe = replace(moe, expert_intermediate_size=moe.expert_intermediate_size // world_size)
    return replace(
        spec,
        num_heads=spec.num_heads // world_size,
        num_kv_heads=spec.num_kv_heads // world_size,
        intermediate_size=spec.intermediate_size // world_size,
        moe=moe,
    )


def first_expert(spec: DecoderSpec, shard: Shard | None) -> int:
    """The first expert (of the model's) that `shard`'s rank holds, in a rank's `spec`."""
    if spec.moe is None or shard is None or not shard.expert_parallel:
        return 0
    return shard.rank * spec.moe.held


def checkpoint_slices(full: DecoderSpec, shard: Shard) -> dict[str, SliceOf]:
    """HF weight name -> the slice rank `shard.rank` reads; names not listed are read whole."""
    world, rank = shard.world_size, shard.rank
    q = full.num_heads * full.head_dim // world
    kv = full.num_kv_heads * full.head_dim // world
    inter = full.intermediate_size // world
    rows = shard.vocab_rows(full.vocab_size)
    slices: dict[str, SliceOf] = {}
    for i in range(full.num_layers):
        src = f"model.layers.{i}."
        kinds = ("weight", "bias") if full.attention_bias else ("weight",)
        for kind in kinds:
            for part, size in (("q", q), ("k", kv), ("v", kv)):
                slices[f"{src}self_attn.{part}_proj.{kind}"] = SliceOf(
                    0, rank * size, size, size * world
                )
        slices[f"{src}self_attn.o_proj.weight"] = SliceOf(1, rank * q, q, q * world)
        if full.attention_sinks:
            heads = full.num_heads // world
            slices[f"{src}self_attn.sinks"] = SliceOf(0, rank * heads, heads, full.num_heads)
        for part in ("gate", "up"):
            slices[f"{src}mlp.{part}_proj.weight"] = SliceOf(0, rank * inter, inter, inter * world)
        slices[f"{src}mlp.down_proj.weight"] = SliceOf(1, rank * inter, inter, inter * world)
    if full.moe is not None:
        slices |= _expert_slices(full, shard)
    vocab = SliceOf(0, shard.vocab_start(full.vocab_size), rows, full.vocab_size)
    slices["model.embed_tokens.weight"] = vocab
    if not full.tie_word_embeddings:
        slices["lm_head.weight"] = vocab
    return slices


def _expert_slices(full: DecoderSpec, shard: Shard) -> dict[str, SliceOf]:
    """A mixture of experts over ranks: the shared expert's MLP columns split as a dense
    MLP's; every expert's too, except under expert parallelism, where a rank reads its experts
    whole (and no other's); the router whole."""
    moe = full.moe
    assert moe is not None
    world, rank = shard.world_size, shard.rank
    slices = {}
    if moe.gpt_oss_experts:  # stacked experts: a rank reads its run of them
        held = moe.num_experts // world
        experts = SliceOf(0, rank * held, held, moe.num_experts)
        names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        return {
            f"model.layers.{i}.mlp.experts.{name}": experts
            for i in range(full.num_layers)
            for name in names
        }
    for i, sparse in enumerate(moe.sparse_layers):
        if not sparse:
            continue
        prefix, (gate, up, down) = expert_weight_names(full.architecture, i)
        parts = []
        if not shard.expert_parallel:
            parts = [(f"{prefix}experts.{e}.", moe.expert_intermediate_size, (gate, up, down))
                     for e in range(moe.num_experts)]  # fmt: skip
        if moe.shared_expert_intermediate_size:
            shared = moe.shared_expert_intermediate_size
            parts.append((f"{prefix}shared_expert.", shared, ("gate_proj", "up_proj", "down_proj")))
        for src, inter, (g, u, d) in parts:
            n = inter // world
            for name in (g, u):
                slices[f"{src}{name}.weight"] = SliceOf(0, rank * n, n, inter)
            slices[f"{src}{d}.weight"] = SliceOf(1, rank * n, n, inter)
    return slices
