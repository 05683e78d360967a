"""The mixture-of-experts fields of a checkpoint's config.json (pure Python): how many
experts, how many each token takes and how their weights are normalized, which layers are
sparse, a shared expert, and gpt-oss's biased router and clamped SwiGLU experts. A field the
engine does not implement is a start error naming `config.json.<field>`."""

from __future__ import annotations

from dataclasses import dataclass

# family -> the config fields whose values other than these are not implemented
_UNSUPPORTED = {
    "scoring_func": ("softmax",),  # DeepSeek's sigmoid scoring
    "topk_method": ("greedy",),  # DeepSeek's grouped top-k
    "n_group": (None, 1),
    "topk_group": (None, 1),
}


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    # Whether the top-k weights are renormalized to sum to 1 (else the softmax's own).
    norm_topk_prob: bool
    # Whether the top-k weights stay float32 against the experts' outputs (Mixtral), or are
    # cast to the activations' dtype first (Qwen).
    float_weights: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one expert every token runs, gated
    # Under expert parallelism, the experts one rank holds (a contiguous run of them); 0: all.
    experts_held: int = 0
    # gpt-oss: the router and every expert's projections carry biases, the top-k weights are
    # the softmax over the k chosen logits alone, and the experts' activation is the clamped
    # SwiGLU (up + 1) * g * sigmoid(alpha * g), g = min(gate, limit), up clamped to ±limit,
    # their gate and up rows interleaved (gate_up[2j] and gate_up[2j + 1]).
    gpt_oss_experts: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss's released checkpoints: the experts' weights in MXFP4 blocks
    # (engine/quant/mxfp4.py), dequantized into the serving dtype at load.
    mxfp4: bool = False

    @property
    def held(self) -> int:
        return self.experts_held or self.num_experts


def expert_weight_names(architecture: str, layer: int) -> tuple[str, tuple[str, str, str]]:
    """A sparse layer's checkpoint prefix (its router is `<prefix>gate.weight`, expert e's
    weights `<prefix>experts.<e>.<name>.weight`) and its experts' (gate, up, down) names.
    (gpt-oss stacks its experts instead: engine/model/weight_loader.py.)"""
    if architecture == "MixtralForCausalLM":
        return f"model.layers.{layer}.block_sparse_moe.", ("w1", "w3", "w2")
    return f"model.layers.{layer}.mlp.", ("gate_proj", "up_proj", "down_proj")


def read_moe(cfg: dict, family: str, num_layers: int) -> MoESpec | None:
    """The checkpoint's MoESpec (None for a dense family). Raises ValueError naming
    config.json's field that the engine cannot serve."""
    if family not in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"):
        return None
    for field, allowed in _UNSUPPORTED.items():
        if cfg.get(field, allowed[0]) not in allowed:
            raise ValueError(
                f"model: config.json.{field} {cfg[field]!r} is not supported (only "
                f"{', '.join(repr(a) for a in allowed if a is not None)})"
            )
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    top_k = cfg.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"model: config.json.num_experts must be >= 1, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"model: config.json.num_experts_per_tok must be in [1, {num_experts}], got {top_k!r}"
        )
    if family == "gpt_oss":  # every layer sparse; the weights a softmax over the top k
        return MoESpec(
            num_experts,
            top_k,
            cfg["intermediate_size"],
            False,
            False,
            (True,) * num_layers,
            gpt_oss_experts=True,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )
    if family == "mixtral":  # every layer sparse, weights renormalized, no shared expert
        return MoESpec(
            num_experts, top_k, cfg["intermediate_size"], True, True, (True,) * num_layers
        )
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"model: config.json.decoder_sparse_step must be >= 1, got {step!r}")
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = cfg.get("shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
    return MoESpec(
        num_experts,
        top_k,
        cfg["moe_intermediate_size"],
        bool(cfg.get("norm_topk_prob", False)),
        False,
        sparse,
        int(shared or 0),
    )
