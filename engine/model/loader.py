"""Read a local HF checkpoint directory's config.json into a DecoderSpec."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from engine.core.errors import InvalidParam
from engine.model.moe_config import MoESpec, read_moe
from engine.quant.scheme import QuantScheme, parse_quantization_config

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
# Families with Qwen's layout: q/k/v biases (qwen2), per-head q/k norms (qwen3), the
# sliding-window fields.
_QWEN2, _QWEN3 = ("qwen2", "qwen2_moe"), ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class DecoderSpec:
    """The shape of a Llama-family decoder (its MLPs dense, or mixtures of experts), read from
    config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q, k and v
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k
    sliding_window: int | None
    quantization: QuantScheme | None = None  # the checkpoint's quantized format
    moe: MoESpec | None = None  # mixture-of-experts layers (None: every MLP dense)
    o_proj_bias: bool = False  # Llama's attention_bias, gpt-oss: a bias on o_proj too
    # gpt-oss: a learned logit per query head that joins every softmax as a key with no
    # value, so a head can attend to nothing.
    attention_sinks: bool = False
    # Per layer, whether `sliding_window` applies to it (gpt-oss alternates windowed and
    # full layers); None: every layer alike.
    window_layers: tuple[bool, ...] | None = None

    def windowed(self, layer: int) -> bool:
        """Whether layer `layer` attends within `sliding_window` (where there is one)."""
        return self.window_layers is None or self.window_layers[layer]


def resolve_max_model_len(value: int | str, spec: DecoderSpec) -> int:
    """`max_model_len` as a number of tokens: `auto` is the model's context; a number beyond
    it is a ValueError."""
    if value == "auto":
        return spec.max_position_embeddings
    if value > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({value}) exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings})"
        )
    return int(value)


def check_model_dir(model: str) -> Path:
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model!r} is not a local checkpoint directory with config.json")
    return path


def read_spec(model: str) -> DecoderSpec:
    path = check_model_dir(model)
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"model: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    quantization = cfg.get("quantization_config")
    mxfp4 = isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"
    scheme = parse_quantization_config(quantization) if quantization and not mxfp4 else None
    moe = read_moe(cfg, family, cfg["num_hidden_layers"])
    if mxfp4:
        if moe is None or not moe.gpt_oss_experts:
            raise InvalidParam(
                "quantization_config.quant_method",
                "model: quantization_config.quant_method 'mxfp4' is served for gpt-oss's "
                f"experts only, not for {arch}",
            )
        moe = replace(moe, mxfp4=True)
    num_heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    attention_bias = bool(cfg.get("attention_bias", cfg.get("qkv_bias", family in _QWEN2)))
    window, window_layers = _sliding_window(cfg, family)
    return DecoderSpec(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=None if rope_type == "default" else dict(rope),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=family in _QWEN3,
        sliding_window=window,
        quantization=scheme,
        moe=moe,
        o_proj_bias=attention_bias and family in ("llama", "gpt_oss"),
        attention_sinks=family == "gpt_oss",
        window_layers=window_layers,
    )


def _sliding_window(cfg: dict, family: str) -> tuple[int | None, tuple[bool, ...] | None]:
    """The window and which layers use it (None: all of them). Per-layer kinds come from
    config `layer_types`, or Qwen's window from layer `max_window_layers` on."""
    window = cfg.get("sliding_window")
    qwen = family in _QWEN2 + _QWEN3
    if window is None or (qwen and not cfg.get("use_sliding_window")):
        return None, None
    num_layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if kinds is None and qwen:
        first = cfg.get("max_window_layers", 0)
        kinds = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
    if kinds is None or set(kinds) == {"sliding_attention"}:
        return window, None
    if set(kinds) == {"full_attention"}:
        return None, None
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown or len(kinds) != num_layers:
        raise ValueError(
            f"model: config.json.layer_types must name one of sliding_attention, "
            f"full_attention per layer, got {kinds!r}"
        )
    return window, tuple(kind == "sliding_attention" for kind in kinds)
