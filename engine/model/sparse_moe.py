"""A mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): a router picks
each token's top-k experts; the tokens are grouped by expert, so that each expert runs one
GEMM over all of its tokens (never a loop over tokens), and the outputs, weighted, are summed
back in the tokens' order; Qwen2-MoE adds a shared expert every token runs, behind a sigmoid
gate.

The experts' weights are stacked: `w13` [E, 2I, H] (gate rows, then up rows; gpt-oss's
interleaved, as its checkpoint has them) and `w2` [E, H, I]; gpt-oss's biases `b13` [E, 2I]
and `b2` [E, H]. Quantized experts are one module each instead (`hold_experts`), whose
quantized linear layers hold the checkpoint's layouts.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cpu.decoder_ops import DecoderOps
from engine.model.moe_config import MoESpec


class SparseMoE(nn.Module):
    def __init__(
        self, hidden_size: int, moe: MoESpec, shared: nn.Module | None, first_expert: int = 0
    ) -> None:
        """`shared`: Qwen2-MoE's shared expert (a dense MLP), or None. Under expert
        parallelism this rank holds `moe.held` experts from `first_expert` on, and its output
        is their share of the sum (the ranks' shares are all-reduced)."""
        super().__init__()
        self.moe, self.first_expert = moe, first_expert
        inter = moe.expert_intermediate_size
        biased = moe.gpt_oss_experts
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=biased)
        self.w13: nn.Parameter | None = nn.Parameter(torch.empty(moe.held, 2 * inter, hidden_size))
        self.w2: nn.Parameter | None = nn.Parameter(torch.empty(moe.held, hidden_size, inter))
        self.b13 = nn.Parameter(torch.empty(moe.held, 2 * inter)) if biased else None
        self.b2 = nn.Parameter(torch.empty(moe.held, hidden_size)) if biased else None
        self.shared_expert = shared
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared else None
        self.expert_mlps: nn.ModuleList | None = None  # see `hold_experts`
        # The fused Triton kernels (engine/model/moe_kernel.py) on CUDA, once the GPU
        # self-check passed them; else the grouped torch path below.
        self.kernel = False

    def forward(self, x: torch.Tensor, ops: DecoderOps) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.kernel:
            from engine.model.moe_kernel import fused_experts

            out = fused_experts(x, self.w13, self.w2, weights, experts, self.first_expert)
        else:
            out = self.experts(x, weights, experts, ops)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out += gate * self.shared_expert(x, ops)
        return out

    def hold_experts(self, mlps: nn.ModuleList) -> None:
        """Hold the experts as one module each (`mlps[h](x, ops)` the h-th held expert's
        gate/up, SiLU and down) instead of the stacked weights: quantized experts
        (engine/quant/loading.py), whose layouts neither the stacked tensors nor the fused
        kernels take. Called on the meta device, before the weights are materialised."""
        assert len(mlps) == self.moe.held and self.b13 is None
        self.w13 = self.w2 = None
        self.expert_mlps = mlps

    def forward_fm(self, x: torch.Tensor, ops: DecoderOps) -> torch.Tensor:
        """`forward` on feature-major activations ([hidden, T] in and out): the experts work on
        token rows, so once through the token-major path."""
        return ops.transposed(self.forward(ops.transposed(x), ops))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k]: the softmax over all
        the experts' logits (float32), renormalized over the top k where the model says;
        gpt-oss's, the softmax over the top k logits."""
        if self.moe.gpt_oss_experts:
            logits, experts = torch.topk(self.gate(x), self.moe.top_k, dim=-1)
            return torch.softmax(logits.float(), dim=-1).to(x.dtype), experts
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.float_weights else weights.to(x.dtype)), experts

    def experts(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, ops: DecoderOps
    ) -> torch.Tensor:
        """Σ_j weights[t, j] · expert_{experts[t, j]}(x[t]) for every token t: the (token,
        choice) pairs sorted by expert, one GEMM pair per expert over its rows, and the rows
        added back to their tokens (in expert order, as transformers sums them)."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // top_k
        row_weights = weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        out = torch.zeros_like(x)
        start = sum(counts[: self.first_expert])  # the rows of the experts other ranks hold
        for held in range(self.moe.held):
            count = counts[self.first_expert + held]
            if not count:
                continue
            rows = tokens[start : start + count]
            y = self._expert(held, x[rows], ops)
            out.index_add_(0, rows, (y * row_weights[start : start + count, None]).to(x.dtype))
            start += count
        return out

    def _expert(self, held: int, x: torch.Tensor, ops: DecoderOps) -> torch.Tensor:
        """The `held`-th expert of this rank on rows `x`."""
        if self.expert_mlps is not None:
            return self.expert_mlps[held](x, ops)
        if self.b13 is None:
            gate_up = torch.nn.functional.linear(x, self.w13[held])
            return torch.nn.functional.linear(ops.silu_mul(gate_up), self.w2[held])
        assert self.b2 is not None
        gate_up = torch.nn.functional.linear(x, self.w13[held], self.b13[held])
        act = clamped_swiglu(gate_up, self.moe.swiglu_alpha, self.moe.swiglu_limit)
        return torch.nn.functional.linear(act, self.w2[held], self.b2[held])


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation over interleaved gate/up columns: (up + 1) * g * sigmoid(alpha * g),
    g = min(gate, limit), up clamped to [-limit, limit]."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def use_moe_kernels(model: nn.Module, device: torch.device) -> None:
    """The fused kernels for every mixture-of-experts layer on CUDA (the self-check may take
    them back); gpt-oss's biased, clamped experts and quantized ones run the grouped torch
    path."""
    for layer in moe_layers(model):
        layer.kernel = device.type == "cuda" and layer.b13 is None and layer.w13 is not None
