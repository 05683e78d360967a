"""Random-weight checkpoints of real models' shapes (Llama's, Qwen3-MoE's and gpt-oss's),
written offline for benchmarks and memory tests (weights only: no tokenizer; they are fed
token ids). gpt-oss's experts are written in MXFP4, as its release has them.

    python -m engine.model.random_checkpoint --shape llama3-8b --out DIR [--device cuda]
        [--quant fp8|fp8-block|awq] [--tokenizer]

With --quant, the decoder layers' linear weights are written quantized, as random codes and
scales in the format's layout and config (compressed-tensors FP8 per channel, FP8 in 128x128
blocks as Qwen3-30B-A3B-FP8 has its experts, or AWQ INT4 with groups of 128): the quantized
benchmarks' checkpoints, without quantizing a float one. A mixture of experts' routers stay
float, as its quantized releases keep them.

With --tokenizer the directory also gets a tokenizer and chat template (the tiny models',
grown to the shape's vocabulary), so it serves over HTTP like any checkpoint.

Tensors are generated one at a time (on the GPU when asked, which is much faster) and
written in shards of about 4 GB, as real checkpoints come.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model.tiny_model import GPT_OSS_ROPE

# name: config.json fields of the architecture's shape.
SHAPES = {
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    # Qwen3-30B-A3B's layer (128 experts of width 768, 8 per token, q/k norms, head_dim 128
    # over hidden 2048) in 12 of its 48 layers: 15 GB in bf16, a GPU's MoE decode per layer.
    "qwen3-30b-a3b-12l": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "head_dim": 128,
        "num_hidden_layers": 12,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
    },
    # The same layer shape at 2 layers and 16 experts 128 wide (128x128 FP8 blocks tile
    # them): the CPU tests of the MoE shape path.
    "qwen3-moe-mini": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
    },
    # gpt-oss-20b's layer (32 experts of width 2880, 4 per token, MXFP4 experts, attention
    # sinks, windowed layers of 128 alternating with full ones, YaRN) in 12 of its 24
    # layers: 7 GB with bf16 attention, a GPU's gpt-oss decode per layer.
    "gpt-oss-20b-12l": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "head_dim": 64,
        "num_hidden_layers": 12,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 6,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "rope_parameters": GPT_OSS_ROPE,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },  # fmt: skip
    },
    # About 500M parameters: the loader's peak-memory test.
    "500m": {
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
    },
}
# The same layer kinds at 2 layers, 8 experts and 64-column blocks: the CPU tests.
SHAPES["gpt-oss-mini"] = SHAPES["gpt-oss-20b-12l"] | {
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "sliding_window": 12,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": GPT_OSS_ROPE | {"original_max_position_embeddings": 64},
}
SHARD_BYTES = 4 << 30


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    experts = cfg.get("num_experts", 0)
    gpt_oss = cfg.get("model_type") == "gpt_oss"
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.get("model_type") == "qwen3_moe":
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,)}
            shapes |= {p + "self_attn.k_norm.weight": (head_dim,)}
        if gpt_oss:
            shapes |= _gpt_oss_layer_shapes(cfg, p, q, kv)
            continue
        if not experts:
            shapes |= {
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
            continue
        width = cfg["moe_intermediate_size"]
        shapes[p + "mlp.gate.weight"] = (experts, h)
        for e in range(experts):
            shapes |= {
                f"{p}mlp.experts.{e}.gate_proj.weight": (width, h),
                f"{p}mlp.experts.{e}.up_proj.weight": (width, h),
                f"{p}mlp.experts.{e}.down_proj.weight": (h, width),
            }
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def _gpt_oss_layer_shapes(cfg: dict, p: str, q: int, kv: int) -> dict[str, tuple[int, ...]]:
    """gpt-oss's attention biases and sinks, biased router, and stacked MXFP4 experts
    (blocks of 32 input columns: 16 bytes and a scale byte each)."""
    h, inter, experts = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    shapes = {
        p + "self_attn.q_proj.bias": (q,),
        p + "self_attn.k_proj.bias": (kv,),
        p + "self_attn.v_proj.bias": (kv,),
        p + "self_attn.o_proj.bias": (h,),
        p + "self_attn.sinks": (cfg["num_attention_heads"],),
        p + "mlp.router.weight": (experts, h),
        p + "mlp.router.bias": (experts,),
        p + "mlp.experts.gate_up_proj_bias": (experts, 2 * inter),
        p + "mlp.experts.down_proj_bias": (experts, h),
    }
    for name, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
        shapes[f"{p}mlp.experts.{name}_blocks"] = (experts, rows, cols // 32, 16)
        shapes[f"{p}mlp.experts.{name}_scales"] = (experts, rows, cols // 32)
    return shapes


def _random_tensor(
    name: str, dims: tuple[int, ...], gen: torch.Generator, device: str
) -> torch.Tensor:
    """Float weights of about 1/sqrt(fan_in), so activations keep their scale through the
    layers; norm gains near 1, biases and sinks near 0; MXFP4 blocks random codes (FP4 values
    average about 2.5 in magnitude) and scales 2^e with 2.5 * 2^e about 1/sqrt(fan_in)."""
    if name.endswith("_blocks"):
        return torch.randint(0, 256, dims, generator=gen, device=device, dtype=torch.uint8)
    if name.endswith("_scales"):
        exponent = round(math.log2((dims[-1] * 32) ** -0.5 / 2.5))
        return torch.full(dims, 127 + exponent, device=device, dtype=torch.uint8)
    if name.endswith("norm.weight"):
        return 1.0 + 0.02 * torch.randn(dims, generator=gen, device=device)
    if len(dims) == 1 or name.endswith("bias"):
        return 0.02 * torch.randn(dims, generator=gen, device=device)
    return torch.randn(dims, generator=gen, device=device) * dims[1] ** -0.5


def make_random_checkpoint(
    out: str | Path,
    shape: str,
    dtype: torch.dtype = torch.bfloat16,
    generate_on: str = "cpu",
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    quant: str | None = None,
    tokenizer: bool = False,
) -> Path:
    """Write the checkpoint (skipped if `out` already holds one) and return its path."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        from engine.model.tiny_model import padded_tokenizer

        padded_tokenizer(SHAPES[shape]["vocab_size"]).save_pretrained(out)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} | SHAPES[shape]
    cfg |= {"rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    gen = torch.Generator(device=generate_on).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, files = 0, []
    weight_map: dict[str, str] = {}
    total_bytes = 0

    def flush() -> None:
        nonlocal shard, size, total_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name))
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        total_bytes += size
        shard, size = {}, 0

    if quant is not None:
        cfg["quantization_config"] = _quant_config(quant, cfg)
    if quant is not None and cfg.get("model_type") == "gpt_oss":
        raise ValueError(f"--quant: {shape} is written in MXFP4, as gpt-oss is released")
    for name, dims in weight_shapes(cfg).items():
        router = name.endswith(".mlp.gate.weight")
        if quant is not None and ".layers." in name and len(dims) == 2 and not router:
            for part, tensor in _random_quantized(quant, dims, gen, generate_on).items():
                shard[name.removesuffix("weight") + part] = tensor.cpu()
                size += tensor.nbytes
            continue
        value = _random_tensor(name, dims, gen, generate_on)
        shard[name] = (value if value.dtype == torch.uint8 else value.to(dtype)).cpu()
        size += shard[name].nbytes
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    # The index lets any loader (transformers too) find each weight's shard.
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    # Last: a directory with config.json is a finished checkpoint.
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


QUANT_CONFIGS = {
    "fp8": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token"},
            }
        },
        "ignore": ["lm_head"],
    },
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    },
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
}


def _quant_config(quant: str, cfg: dict) -> dict:
    """QUANT_CONFIGS[quant], with a mixture of experts' routers among the modules left
    float."""
    config = json.loads(json.dumps(QUANT_CONFIGS[quant]))
    if cfg.get("num_experts"):
        key = "ignore" if "ignore" in config else "modules_to_not_convert"
        routers = [f"model.layers.{n}.mlp.gate" for n in range(cfg["num_hidden_layers"])]
        config[key] = config.get(key, []) + routers
    return config


def _random_quantized(
    quant: str, dims: tuple[int, ...], gen: torch.Generator, device: str
) -> dict[str, torch.Tensor]:
    """One [out, in] linear weight's tensors in `quant`'s layout, with random codes whose
    dequantized values are about 1/sqrt(fan_in), as the float checkpoint's."""
    n, k = dims
    if quant.startswith("fp8"):
        codes = torch.randn(dims, generator=gen, device=device) * 64
        weight = codes.to(torch.float8_e4m3fn)
        if quant == "fp8-block":
            scale = torch.full((-(-n // 128), -(-k // 128)), k**-0.5 / 64, device=device)
            return {"weight": weight, "weight_scale_inv": scale}
        scale = torch.full((n, 1), k**-0.5 / 64, device=device)
        return {"weight": weight, "weight_scale": scale.bfloat16()}
    groups = k // 128

    def words(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31, (rows, cols), generator=gen, device=device).int()

    scales = torch.full((groups, n), k**-0.5 / 5, device=device, dtype=torch.float16)
    return {"qweight": words(k, n // 8), "qzeros": words(groups, n // 8), "scales": scales}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quant", choices=sorted(QUANT_CONFIGS), default=None)
    parser.add_argument("--tokenizer", action="store_true", help="add a tokenizer (serving)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    path = make_random_checkpoint(
        args.out, args.shape, dtype, args.device, quant=args.quant, tokenizer=args.tokenizer
    )
    print(f"wrote {args.shape} checkpoint to {path}")


if __name__ == "__main__":
    main()
