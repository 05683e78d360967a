"""A mixture-of-experts layer's time per step against a dense MLP of the same active
parameters, in the same run.

    python -m loadtests.bench_moe [--shape qwen3-30b-a3b|gpt-oss-20b|mixtral|tiny]
        [--tokens 1,32,128,512] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--repeat 20] [--json]

For each step size: the median time of one MoE layer's MLP (router, the experts the step's
tokens chose, weighted sum back) on each of its paths (`grouped`: one GEMM pair per expert
over its tokens; `fused`: the Triton kernels, on CUDA where the layer has no biases), and of
a dense MLP of width k x the expert width (the FLOPs a token runs through are the same);
`ratio` is the MoE's time over the dense one's. A MoE step reads every expert some token chose
(`experts_touched`), so at batch sizes where that is most of them it moves many times the
dense MLP's bytes: the ratio shows where grouping pays and where the bytes dominate.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from functools import partial

import torch

from engine.model.decoder import MLP, Decoder
from engine.model.loader import DecoderSpec
from engine.model.moe_config import MoESpec
from engine.model.sparse_moe import SparseMoE
from loadtests.bench_decode import median_ms


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    experts: int
    top_k: int
    width: int  # one expert's MLP width
    gpt_oss: bool = False  # biased router and experts, clamped SwiGLU


SHAPES = {
    "qwen3-30b-a3b": LayerShape(2048, 128, 8, 768),
    "gpt-oss-20b": LayerShape(2880, 32, 4, 2880, gpt_oss=True),
    "mixtral": LayerShape(4096, 8, 2, 14336),
    "tiny": LayerShape(256, 16, 4, 96),  # the CPU smoke shape
}


def _decoder(shape: LayerShape, moe: MoESpec | None, native_ops: bool) -> Decoder:
    """A one-layer decoder of the shape's MLP (its attention and vocabulary minimal): the
    layer as the engine builds and runs it."""
    spec = DecoderSpec(
        architecture="GptOssForCausalLM" if shape.gpt_oss else "Qwen3MoeForCausalLM",
        vocab_size=16,
        hidden_size=shape.hidden,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=shape.top_k * shape.width,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=16,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        sliding_window=None,
        moe=moe,
    )
    return Decoder(spec, 16, native_ops)


def _layers(shape: LayerShape, device: str, dtype: torch.dtype) -> tuple[SparseMoE, MLP, Decoder]:
    """The MoE layer, the dense MLP of the same active parameters, and the decoder whose ops
    they run with."""
    spec = MoESpec(
        shape.experts, shape.top_k, shape.width, True, False, (True,), gpt_oss_experts=shape.gpt_oss
    )
    native = device == "cpu" and dtype == torch.float32
    sparse, dense = _decoder(shape, spec, native), _decoder(shape, None, native)
    moe, mlp = sparse.layers[0].mlp, dense.layers[0].mlp
    assert isinstance(moe, SparseMoE) and isinstance(mlp, MLP)
    gen = torch.Generator().manual_seed(0)
    for layer in (moe, mlp):
        for param in layer.parameters():
            param.data.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return moe.to(device, dtype).eval(), mlp.to(device, dtype).eval(), dense


@torch.no_grad()
def measure(shape: LayerShape, tokens: list[int], device: str, dtype: str, repeat: int) -> dict:
    torch_dtype = getattr(torch, dtype)
    moe, dense, decoder = _layers(shape, device, torch_dtype)
    ops = decoder.ops
    paths = ["grouped"] + (["fused"] if device == "cuda" and not shape.gpt_oss else [])
    rows = []
    for n in tokens:
        x = torch.randn(n, shape.hidden, generator=torch.Generator().manual_seed(n))
        x = x.to(device, torch_dtype)
        row: dict[str, float] = {"tokens": n}
        for path in paths:
            moe.kernel = path == "fused"
            row[f"moe_{path}_ms"] = median_ms(partial(moe, x, ops), device, repeat)
        row["dense_ms"] = median_ms(partial(dense, x, ops), device, repeat)
        _, experts = moe.route(x)
        row["experts_touched"] = int(experts.unique().numel())
        best = min(row[f"moe_{path}_ms"] for path in paths)
        row["ratio"] = best / row["dense_ms"]
        rows.append(row)
    return {"shape": shape.__dict__, "device": device, "dtype": dtype, "steps": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--tokens", default="1,32,128,512")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    result = measure(SHAPES[args.shape], tokens, args.device, args.dtype, args.repeat)
    result["shape"]["name"] = args.shape
    for row in result["steps"]:
        times = "  ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms"))
        print(
            f"{row['tokens']:>5} tokens  {times}  experts touched {row['experts_touched']}"
            f"  MoE/dense {row['ratio']:.2f}x"
        )
    if args.json:
        json.dump(result, sys.stdout)
        print()
    return result


if __name__ == "__main__":
    main()
