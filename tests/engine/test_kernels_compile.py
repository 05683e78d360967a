"""Every Triton kernel of the GPU path compiles for an H100 (sm_90, down to its cubin) on this
machine, without a GPU. Triton's interpreter runs a kernel's Python on CPU tensors and never
calls the compiler, so what only the compiler refuses (a module global that is not a
constexpr, a type or an op the GPU lowering lacks) would otherwise wait for a GPU session.

The compiles run in a child process: other test modules turn the interpreter on for the
whole session, and kernels defined under it are not the compiler's to compile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.attention import triton_kernels
from engine.quant.dequant_gemm_kernel import _dequant_gemm
from engine.sampling.token_draw_kernel import _draw

H100 = GPUTarget("cuda", 90, 32)


def _compile(fn, signature: dict[str, str], constexprs: dict, num_warps: int = 4) -> None:
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(source, target=H100, options={"num_warps": num_warps})
    assert kernel.asm["cubin"]
    print("compiled", flush=True)


def test_every_gpu_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.run(
        [sys.executable, "-m", "tests.engine.test_kernels_compile"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split() == ["compiled"] * 26


def compile_the_draw_kernel(logits: str) -> None:
    pointers = ("temperature", "top_k", "top_p", "min_p", "u", "token", "threshold")
    types = {"top_k": "*i64", "token": "*i64"}
    signature = {"logits_ptr": f"*{logits}", "row_stride": "i32"}
    signature |= {f"{name}_ptr": types.get(name, "*fp32") for name in pointers}
    signature["vocab"] = "i32"
    _compile(_draw, signature, {"BLOCK": 1024}, num_warps=8)


def compile_the_attention_kernels(
    dtype: str, head_dim: int, group: int, rows: int, fp8: bool = False, sinks: bool = False
) -> None:
    cache = "u8" if fp8 else dtype
    signature = {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}"}
    signature |= {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "sinks_ptr": f"*{dtype}"}
    signature |= {"out_ptr": f"*{dtype}"}
    signature |= {"block_table_ptr": "*i32", "query_start_ptr": "*i32", "seq_len_ptr": "*i32"}
    signature |= {"qk_scale": "fp32", "window": "i32"}
    strides = ("qt", "qh", "ot", "oh", "kb", "ks", "kh", "bt")
    signature |= {f"stride_{name}": "i32" for name in strides}
    group_p = triton.next_power_of_2(group)
    constexprs = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": head_dim,
        "BLOCK_SIZE": 16,
        "BLOCK_N": 64,
        "TOKENS": max(1, rows // group_p),
        "GROUP": group,
        "GROUP_P": group_p,
        "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
        "DOT_FLOAT32": dtype == "fp32",
        "FP8": fp8,
        "SINKS": sinks,
    }
    num_warps = 8 if rows * head_dim >= 64 * 128 else 4  # as paged_attention launches it
    _compile(triton_kernels._paged_attention, signature, constexprs, num_warps)
    write = {f"{name}_ptr": f"*{dtype}" for name in ("k", "v", "k_cache", "v_cache")}
    write |= {"slot_ptr": "*i64", "stride_kt": "i32", "stride_vt": "i32", "stride_cs": "i32"}
    row = 8 * head_dim
    _compile(triton_kernels._write_kv, write, {"ROW": row, "BLOCK": row})


def compile_the_dequant_gemm(
    dtype: str, int4: bool, block_m: int, scale_block: tuple[int, int] = (128, 128)
) -> None:
    signature = {"x_ptr": f"*{dtype}", "w_ptr": "*i32" if int4 else "*u8", "scale_ptr": "*fp32"}
    signature |= {"zero_ptr": "*u8" if int4 else "*fp32", "group_ptr": "*i32" if int4 else "*fp32"}
    signature["y_ptr"] = f"*{dtype}"
    for name in ("M", "N", "K", "stride_xm", "stride_ym", "num_groups", "scale_cols"):
        signature[name] = "i32"
    rows, cols = (1, 1) if int4 else scale_block
    constexprs = {"INT4": int4, "SCALE_ROWS": rows, "SCALE_COLS": cols}
    constexprs |= {"IEEE": dtype == "fp32", "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64}
    _compile(_dequant_gemm, signature, constexprs)


def compile_the_moe_kernels(dtype: str) -> None:
    from engine.model import moe_kernel

    blocks = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}
    constexprs = blocks | {"DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    pointers = {"pairs_ptr": "*i32", "block_expert_ptr": "*i32"}
    gate_up = {"x_ptr": f"*{dtype}", "w13_ptr": f"*{dtype}", "act_ptr": "*fp32"} | pointers
    for name in ("num_pairs", "top_k", "H", "INTER", "stride_xt", "stride_we", "stride_wn"):
        gate_up[name] = "i32"
    gate_up["stride_at"] = "i32"
    _compile(moe_kernel._gate_up_act, gate_up, constexprs)
    down = {"act_ptr": "*fp32", "w2_ptr": f"*{dtype}", "weight_ptr": "*fp32", "y_ptr": "*fp32"}
    down |= pointers
    for name in ("num_pairs", "H", "INTER", "stride_at", "stride_we", "stride_wn", "stride_yt"):
        down[name] = "i32"
    _compile(moe_kernel._down_weighted, down, constexprs)


if __name__ == "__main__":
    for dtype in ("bf16", "fp32"):
        compile_the_moe_kernels(dtype)
    compile_the_dequant_gemm("bf16", True, 16)
    compile_the_dequant_gemm("bf16", False, 64)
    compile_the_dequant_gemm("fp32", True, 32)
    compile_the_dequant_gemm("bf16", False, 16, (1, 1 << 30))  # FP8 rows: weight-only
    for logits in ("bf16", "fp32"):
        compile_the_draw_kernel(logits)
    for config in [("bf16", 128, 4, 16), ("bf16", 128, 4, 64), ("fp16", 64, 1, 64)]:
        compile_the_attention_kernels(*config)
    compile_the_attention_kernels("fp32", 128, 8, 16)
    compile_the_attention_kernels("bf16", 128, 4, 16, fp8=True)
    compile_the_attention_kernels("bf16", 128, 4, 64, fp8=True)
    compile_the_attention_kernels("bf16", 64, 8, 16, sinks=True)  # gpt-oss's heads
    compile_the_attention_kernels("bf16", 64, 8, 64, sinks=True)
