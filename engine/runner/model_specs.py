"""The shapes of the decoder models the cost model prices steps of (pure Python)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from engine.quant.scheme import parse_quantization_config


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only model; `tp` GPUs share it by tensor parallelism."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tp: int = 1
    tied_embeddings: bool = False
    linear_bytes: float | None = None  # bytes per decoder-layer weight; None: dtype_bytes
    kv_dtype_bytes: int | None = None  # bytes per cached K or V value; None: dtype_bytes
    fp8_gemms: bool = False  # linear layers run FP8 x FP8 GEMMs (FP8 weights, dynamic FP8 acts)
    # A mixture of experts (every layer's MLP): experts per layer, those each token runs, and
    # each one's MLP width. 0 experts: dense MLPs of intermediate_size.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0

    @property
    def attention_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return h * (q + 2 * kv) + q * h

    @property
    def expert_params(self) -> int:
        """One expert's (gate, up and down projections)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def layer_params(self) -> int:
        """One layer's parameters, every expert's included."""
        if self.num_experts:
            router = self.hidden_size * self.num_experts
            return self.attention_params + router + self.num_experts * self.expert_params
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def active_layer_params(self) -> int:
        """The parameters one token runs through in a layer (its experts only)."""
        if self.num_experts:
            unused = (self.num_experts - self.experts_per_token) * self.expert_params
            return self.layer_params - unused
        return self.layer_params

    def experts_touched(self, tokens: int) -> float:
        """The experts per layer a step of `tokens` tokens reads, expected where each token
        picks its k of E uniformly: E·(1 - (1 - k/E)^tokens)."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def step_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` tokens reads: all of a dense model's; a mixture of
        experts' all but the experts no token of the step chose."""
        if not self.num_experts:
            return self.weight_bytes
        linear = self.dtype_bytes if self.linear_bytes is None else self.linear_bytes
        untouched = self.num_experts - self.experts_touched(tokens)
        return self.weight_bytes - self.num_layers * untouched * self.expert_params * linear

    @property
    def lora_params_per_rank(self) -> int:
        """One layer's LoRA parameters per unit of rank, adapting every linear layer (each
        adds A [r, in] and B [out, r])."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return 7 * h + 2 * q + 2 * kv + 3 * self.intermediate_size

    @property
    def num_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    @property
    def weight_bytes(self) -> float:
        linear = self.dtype_bytes if self.linear_bytes is None else self.linear_bytes
        embeddings = self.num_params - self.num_layers * self.layer_params
        return self.num_layers * self.layer_params * linear + embeddings * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        value = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * value

    def quantized(self, weights: str | None = None, kv_cache_dtype: str = "auto") -> ModelSpec:
        """This model as a replica serves it with `weights` ("fp8": FP8 weights and GEMMs,
        one float32 scale per output row; "fp8_block": FP8 weights with a float32 scale per
        128x128 block, dequantized in the GEMM; "int4": 4-bit weights with a float32 scale
        and a zero point per group of 128, as engine/quant/linear.py holds them) and an FP8
        KV cache ("fp8_e4m3")."""
        spec = self
        if weights == "fp8":
            spec = replace(spec, linear_bytes=1.0, fp8_gemms=True, name=f"{spec.name}+fp8")
        elif weights == "fp8_block":
            spec = replace(spec, linear_bytes=1.0 + 4 / 128**2, name=f"{spec.name}+fp8-block")
        elif weights == "int4":
            spec = replace(spec, linear_bytes=0.5 + 5 / 128, name=f"{spec.name}+int4")
        elif weights is not None:
            raise ValueError(f"weights must be fp8, fp8_block, int4 or None, got {weights!r}")
        if kv_cache_dtype == "fp8_e4m3":
            spec = replace(spec, kv_dtype_bytes=1, name=f"{spec.name}+kv-fp8")
        return spec

    def with_tp(self, tp: int) -> ModelSpec:
        return replace(self, name=f"{self.name.split('@')[0]}@tp{tp}", tp=tp)

    @classmethod
    def from_hf_config(cls, model_dir: str | Path, dtype_bytes: int = 4) -> ModelSpec:
        """The spec of a local HF checkpoint (config.json only; no weights are read), its
        linear layers' bytes those of its quantized format where it has one (gpt-oss's MXFP4
        experts are served dequantized)."""
        path = Path(model_dir)
        cfg = json.loads((path / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_experts", cfg.get("num_local_experts")) or 0
        spec = cls(
            name=path.name,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            dtype_bytes=dtype_bytes,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
            expert_intermediate_size=(
                cfg.get("moe_intermediate_size") or cfg["intermediate_size"] if experts else 0
            ),
        )
        quantization = cfg.get("quantization_config")
        if not quantization or quantization.get("quant_method") == "mxfp4":
            return spec
        return spec.quantized(parse_quantization_config(quantization).layout)


# Shapes from each model's published config.json.
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("Llama-2-7B", 32, 4096, 32, 32, 128, 11008, 32000),
        ModelSpec("Llama-2-13B", 40, 5120, 40, 40, 128, 13824, 32000),
        ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
        # Mixtures of experts: (experts, per token, each one's width).
        ModelSpec(
            "Mixtral-8x7B",
            32,
            4096,
            32,
            8,
            128,
            14336,
            32000,
            num_experts=8,
            experts_per_token=2,
            expert_intermediate_size=14336,
        ),
        ModelSpec(
            "Qwen3-30B-A3B",
            48,
            2048,
            32,
            4,
            128,
            6144,
            151936,
            num_experts=128,
            experts_per_token=8,
            expert_intermediate_size=768,
        ),
        # gpt-oss's MXFP4 experts as served here: dequantized to bf16.
        ModelSpec(
            "gpt-oss-20b",
            24,
            2880,
            64,
            8,
            64,
            2880,
            201088,
            num_experts=32,
            experts_per_token=4,
            expert_intermediate_size=2880,
        ),
    )  # fmt: skip
}
