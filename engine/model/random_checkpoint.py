"""Random-weight Llama checkpoints of real models' shapes, written offline for benchmarks
and memory tests (weights only: no tokenizer; they are fed token ids).

    python -m engine.model.random_checkpoint --shape llama3-8b --out DIR [--device cuda]

Tensors are generated one at a time (on the GPU when asked, which is much faster) and
written in shards of about 4 GB, as real checkpoints come.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

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
SHARD_BYTES = 4 << 30


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def make_random_checkpoint(
    out: str | Path,
    shape: str,
    dtype: torch.dtype = torch.bfloat16,
    generate_on: str = "cpu",
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write the checkpoint (skipped if `out` already holds one) and return its path."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama")
    cfg |= {"rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    gen = torch.Generator(device=generate_on).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, files = 0, []

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name))
        files.append(name)
        shard, size = {}, 0

    for name, dims in weight_shapes(cfg).items():
        if len(dims) == 1:  # norm gains near 1
            value = 1.0 + 0.02 * torch.randn(dims, generator=gen, device=generate_on)
        else:  # about 1/sqrt(fan_in), so activations keep their scale through the layers
            value = torch.randn(dims, generator=gen, device=generate_on) * dims[1] ** -0.5
        shard[name] = value.to(dtype).cpu()
        size += shard[name].nbytes
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    # Last: a directory with config.json is a finished checkpoint.
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    path = make_random_checkpoint(args.out, args.shape, getattr(torch, args.dtype), args.device)
    print(f"wrote {args.shape} checkpoint to {path}")


if __name__ == "__main__":
    main()
