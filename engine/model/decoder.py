"""Our own Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, and the mixtures of experts
Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) over a paged KV cache.

One forward runs every scheduled token of every request as one packed batch (no padding);
attention goes through the AttentionBackend interface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.base import AttentionBackend, KVScales, calculate_kv_scales
from engine.cpu.decoder_ops import DecoderOps
from engine.cpu.packed_weights import PackedLinear
from engine.model.linear_layers import LINEARS
from engine.model.loader import DecoderSpec
from engine.model.rms_norm import RMSNorm
from engine.model.rope import RotaryEmbedding
from engine.model.sharding import first_expert
from engine.model.sparse_moe import SparseMoE

if TYPE_CHECKING:
    from engine.lora.layer_lora import LayerLoRA
    from engine.model.collectives import TensorParallel

# Feature-major GEMMs win at decode batch sizes and not at prefill sizes, where the layout
# transposes cost more than they save (docs/cpu-kernels.md).
FEATURE_MAJOR_MAX_TOKENS = 512


def _adapted(
    lora: LayerLoRA | None, module: str, out: torch.Tensor, x: torch.Tensor, dim: int = 0
) -> torch.Tensor:
    """`out`, the output of linear layer `module` on `x`, plus its rows' LoRA deltas."""
    if lora is not None:
        lora.add(module, out, x, dim)
    return out


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        # q, k and v in one GEMM: one big matmul is faster than three small ones.
        self.qkv_proj = nn.Linear(
            spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim**-0.5
        # gpt-oss: each head's sink logit (engine/model/loader.py); its windowed and full
        # layers alternate.
        self.sinks = nn.Parameter(torch.empty(spec.num_heads)) if spec.attention_sinks else None
        self.windowed = spec.windowed(index)
        # An FP8 KV cache's scales (engine/model/weight_loader.py sets them); with
        # `calculate_kv_scales`, the next step with tokens sets them from its keys and values.
        self.kv_scales: KVScales | None = None
        self.calculate_kv_scales = False
        self.lora: LayerLoRA | None = None  # LoRA adapters' deltas (engine/lora/)

    def forward(
        self,
        x: torch.Tensor,
        rotate: Callable[[torch.Tensor], torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        metadata: object,
    ) -> torch.Tensor:
        qkv = _adapted(self.lora, "self_attn.qkv_proj", self.qkv_proj(x), x)
        out = self.attend(qkv, rotate, kv_cache, backend, metadata)
        return _adapted(self.lora, "self_attn.o_proj", self.o_proj(out), out)

    def forward_fm(
        self,
        x: torch.Tensor,
        rotate: Callable[[torch.Tensor], torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        metadata: object,
        ops: DecoderOps,
    ) -> torch.Tensor:
        """`forward` on feature-major activations ([hidden, T] in and out)."""
        qkv = ops.mm_fm(self.qkv_proj.weight, x)
        if self.qkv_proj.bias is not None:
            qkv += self.qkv_proj.bias[:, None]
        _adapted(self.lora, "self_attn.qkv_proj", qkv, x, 1)
        # Attention works per token: one transpose of q/k/v, then the token-major path.
        out = self.attend(ops.transposed(qkv), rotate, kv_cache, backend, metadata).t()
        o = ops.mm_fm(self.o_proj.weight, out)
        if self.o_proj.bias is not None:
            o += self.o_proj.bias[:, None]
        return _adapted(self.lora, "self_attn.o_proj", o, out, 1)

    def attend(
        self,
        qkv: torch.Tensor,
        rotate: Callable[[torch.Tensor], torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        metadata: object,
    ) -> torch.Tensor:
        """Token-major [T, q + 2 kv] projections -> attention output [T, q]."""
        t = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat(
                [self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], 1
            )
        # q and k rotated together: one pass over both instead of two.
        qk = rotate(qk)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if self.calculate_kv_scales and t:
            assert self.kv_scales is not None
            calculate_kv_scales(self.kv_scales, k, v)
            self.calculate_kv_scales = False
        out = backend.forward(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            metadata,
            self.scale,
            kv_scales=self.kv_scales,
            sinks=self.sinks,
            windowed=self.windowed,
        )
        return out.reshape(t, self.q_size)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.lora: LayerLoRA | None = None  # LoRA adapters' deltas (engine/lora/)

    def forward(self, x: torch.Tensor, ops: DecoderOps) -> torch.Tensor:
        act = ops.silu_mul(_adapted(self.lora, "mlp.gate_up_proj", self.gate_up_proj(x), x))
        return _adapted(self.lora, "mlp.down_proj", self.down_proj(act), act)

    def forward_fm(self, x: torch.Tensor, ops: DecoderOps) -> torch.Tensor:
        gate_up = _adapted(
            self.lora, "mlp.gate_up_proj", ops.mm_fm(self.gate_up_proj.weight, x), x, 1
        )
        act = ops.silu_mul_fm(gate_up)
        return _adapted(self.lora, "mlp.down_proj", ops.mm_fm(self.down_proj.weight, act), act, 1)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, index: int, first_expert: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, index)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp: MLP | SparseMoE
        if is_sparse(spec, index):
            assert spec.moe is not None
            shared = spec.moe.shared_expert_intermediate_size
            expert = MLP(spec.hidden_size, shared) if shared else None
            self.mlp = SparseMoE(spec.hidden_size, spec.moe, expert, first_expert)
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size)


def is_sparse(spec: DecoderSpec, layer: int) -> bool:
    """Whether layer `layer`'s MLP is a mixture of experts."""
    return spec.moe is not None and spec.moe.sparse_layers[layer]


class Decoder(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        max_positions: int,
        native_ops: bool = True,
        tp: TensorParallel | None = None,
    ) -> None:
        """`spec` is this decoder's own shape: with `tp`, one rank's shard
        (engine/model/sharding.py), whose vocabulary stays whole."""
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.loaded_bytes = 0  # set by the weight loader
        self.ops = DecoderOps(native_ops)
        # Where the native ops apply (CPU float32), steps of at most this many tokens run
        # feature-major (see `_forward_feature_major`); 0 turns that off. As far as the
        # native GEMM goes (all sizes with its AVX-512 build), since it beats MKL there.
        self.feature_major_max_tokens = max(FEATURE_MAJOR_MAX_TOKENS, self.ops.gemm_fm_max_tokens)
        vocab_rows = spec.vocab_size if tp is None else tp.shard.vocab_rows(spec.vocab_size)
        self.embed_tokens = nn.Embedding(vocab_rows, spec.hidden_size)
        first = first_expert(spec, tp.shard if tp is not None else None)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, first) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, vocab_rows, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(
            spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling
        )

    # no_grad, not inference_mode: torch.compile cannot functionalise the in-place cache
    # writes of a graph run in inference mode (the runner's steps run in it anyway).
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        metadata: object,
        logits_indices: torch.Tensor,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        """Return float32 logits [len(logits_indices), vocab] for the tokens to sample from;
        with `hidden_only`, their final hidden states instead (`logits` finishes them)."""
        h = self._embed(input_ids)  # a fresh tensor: the residual stream, updated in place
        small = len(input_ids) <= self.feature_major_max_tokens
        if small and self.ops.applies(h) and not hidden_only:
            return self._forward_feature_major(
                h, positions, kv_caches, backend, metadata, logits_indices
            )
        ops = self.ops
        rotate = ops.rotary(self.rope, positions, h.dtype)  # tables once per step
        x = ops.add_rms_norm(h, None, self.layers[0].input_layernorm)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            a = self._reduce(layer.self_attn(x, rotate, kv_cache, backend, metadata))
            x = ops.add_rms_norm(h, a, layer.post_attention_layernorm)
            m = self._reduce(layer.mlp(x, ops))
            if i < last:  # the residual add fused with the next layer's input norm
                x = ops.add_rms_norm(h, m, self.layers[i + 1].input_layernorm)
            else:
                h += m
        # Only the rows we sample from need the final norm and the (large) vocab projection.
        h = self.norm(h[logits_indices])
        return h if hidden_only else self.logits(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states."""
        return self._whole_vocab(self.lm_head(hidden)).float()

    # ------------------------------------------------------------- tensor parallelism
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel where split: each rank looks up the ids in its rows, zeros for
        the others, and the sum over ranks is every row."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        rows = self.embed_tokens.num_embeddings
        local = input_ids - self.tp.shard.rank * rows
        outside = (local < 0) | (local >= rows)
        h = self.embed_tokens(local.clamp(0, rows - 1))
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0.0))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel projection's partial output."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _whole_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[tokens, this rank's vocabulary rows] -> [tokens, vocabulary] from every rank."""
        if self.tp is None:
            return logits
        return self.tp.all_gather_columns(logits)[:, : self.spec.vocab_size]

    def _forward_feature_major(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        metadata: object,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` with activations stored [features, tokens] (CPU float32 with the native
        ops). Every GEMM is then `weight @ activations`, which MKL runs faster than
        `activations @ weight.T` at a decode step's few rows (docs/cpu-kernels.md)."""
        ops = self.ops
        h = ops.transposed(h)
        rotate = ops.rotary(self.rope, positions, h.dtype)
        x = ops.add_rms_norm_fm(h, None, self.layers[0].input_layernorm)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            a = layer.self_attn.forward_fm(x, rotate, kv_cache, backend, metadata, ops)
            a = self._reduce(a)
            x = ops.add_rms_norm_fm(h, a, layer.post_attention_layernorm)
            m = self._reduce(layer.mlp.forward_fm(x, ops))
            if i < last:
                x = ops.add_rms_norm_fm(h, m, self.layers[i + 1].input_layernorm)
            else:
                h += m
        h = ops.add_rms_norm_fm(h[:, logits_indices].contiguous(), None, self.norm)
        # A [tokens, vocab] view of the [vocab, tokens] product: the sampler reads it as is.
        return self._whole_vocab(ops.mm_fm(self.lm_head.weight, h).t())

    def _gemm_weight_names(self) -> list[str]:
        """The Linear layers only GEMMs read (a tied LM head is the embedding too); the
        experts' stacked weights are not Linear layers."""
        names = [
            f"layers.{i}.{sub}"
            for i in range(len(self.layers))
            for sub in LINEARS
            if not (is_sparse(self.spec, i) and sub.startswith("mlp."))
        ]
        return names if self.spec.tie_word_embeddings else [*names, "lm_head"]

    def pack_weights(self) -> None:
        """Move the GEMM weights to the native GEMM's W16 layout where `ops.packs_weights`
        and the model is CPU float32 (call after loading and moving the model), so small decode
        steps stream each weight block once. The row-major copies are dropped. Elsewhere a
        no-op."""
        if not (self.ops.packs_weights and self.ops.applies(self.norm.weight)):
            return
        for name in self._gemm_weight_names():
            module = self.get_submodule(name)
            if isinstance(module, nn.Linear):
                self.set_submodule(name, PackedLinear(module))

    def unpack_weights(self) -> None:
        """Undo `pack_weights` (A/B runs of the row-major layout)."""
        for name in self._gemm_weight_names():
            module = self.get_submodule(name)
            if isinstance(module, PackedLinear):
                self.set_submodule(name, module.unpacked())
