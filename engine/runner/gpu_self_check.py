"""The GPU self-check (`engine.gpu_self_check`): before a replica says it is ready, each GPU
kernel it will use runs once on a small random input on its device and is compared with the
torch reference. A kernel that raises or disagrees is replaced by the reference for that
part (the attention backend by `torch`, a quantized GEMM by dequantize-then-GEMM, the draw
kernel by the sorted draw, decode graphs by eager steps), the reason is logged, and the
replica serves on. Parts already on their reference are not checked.

Parts: `attention`, `fp8_gemm`, `fp8_block_gemm`, `int4_gemm`, `token_draw`, `moe` (the
fused mixture-of-experts kernels), `lora` (LoRA's segmented kernels; checked before decode
graphs are captured, so graphs capture what passed), then `decode_graph`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from engine.attention.base import FP8_KV, BatchLayout
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import SamplingParams
from engine.model.sparse_moe import SparseMoE, moe_layers
from engine.quant.linear import (
    FAST_KERNELS,
    QuantizedLinear,
    quantized_layers,
    reference_kernel,
)
from engine.runner.decode_graphs import DecodeGraphs
from engine.runner.decode_inputs import decode_forward
from engine.runner.device_model import DeviceModel
from engine.sampling import token_draw

logger = logging.getLogger(__name__)

# Largest RMS error, relative to the reference's RMS, a kernel may show: float32 kernels
# differ from the reference by summation order only; 16-bit ones by their roundings; FP8
# GEMMs also quantize activations per token.
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}
_FP8_GEMM_TOLERANCE = 0.1
_GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class PartCheck:
    part: str
    result: str  # "pass" or "fallback"
    reason: str  # why it fell back ("" when it passed)


def check_kernels(dm: DeviceModel) -> list[PartCheck]:
    """Check the attention backend, the quantized GEMMs, the draw kernel and LoRA's kernels
    of `dm`. A failing GEMM, draw or LoRA kernel is replaced in its layer, sampler or slots;
    a failing attention backend is the caller's to replace (its verdict says so)."""
    results = []
    if dm.backend.name in ("triton", "flashinfer"):
        results.append(_check("attention", partial(_attention, dm), lambda: None))
    for layout, (part, _) in FAST_KERNELS.items():
        layers = [q for q in quantized_layers(dm.model) if q.layout == layout]
        if not layers or layers[0].kernel is reference_kernel:
            continue
        tolerance = _FP8_GEMM_TOLERANCE if layout == "fp8" else None
        run = partial(_gemm, layers[0], dm.dtype)
        results.append(_check(part, run, partial(_use_reference, layers), tolerance))
    sampler = dm.sampler
    if dm.device.type == "cuda" or sampler.draw_rows is not token_draw.draw:

        def draw_fallback() -> None:
            sampler.draw_rows = token_draw.draw_by_sort

        results.append(_check("token_draw", partial(_draw, dm), draw_fallback, exact=True))
    moe = [layer for layer in moe_layers(dm.model) if layer.kernel]
    if moe:

        def moe_fallback() -> None:
            for layer in moe:
                layer.kernel = False

        results.append(_check("moe", partial(_moe, moe[0]), moe_fallback))
    lora = dm.lora
    if lora is not None and lora.kernel:

        def lora_fallback() -> None:
            lora.kernel = False

        results.append(_check("lora", partial(_lora, dm), lora_fallback))
    return results


def check_graphs(graphs: DecodeGraphs, dm: DeviceModel) -> list[PartCheck]:
    """Replay one captured decode graph against the same step run eagerly; on a mismatch
    the caller runs every step eagerly (its verdict says so)."""
    return [_check("decode_graph", lambda: _graph(graphs, dm), lambda: None)]


def fell_back(checks: list[PartCheck], part: str) -> bool:
    return any(c.part == part and c.result == "fallback" for c in checks)


def _check(
    part: str,
    run: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    fallback: Callable[[], None],
    tolerance: float | None = None,
    exact: bool = False,
) -> PartCheck:
    try:
        with torch.inference_mode():
            got, want = run()
        problem = _mismatch(got, want, tolerance, exact)
    except Exception as exc:  # noqa: BLE001 - any failure of a kernel means: do not use it
        problem = f"{type(exc).__name__}: {exc}"[:300]
    if problem is None:
        logger.info("GPU self-check: %s passed", part)
        return PartCheck(part, "pass", "")
    fallback()
    logger.warning("GPU self-check: %s falls back to the reference (%s)", part, problem)
    return PartCheck(part, "fallback", problem)


def _mismatch(
    got: torch.Tensor, want: torch.Tensor, tolerance: float | None, exact: bool
) -> str | None:
    """Why `got` is not `want` within the tolerance of `want`'s dtype (or `tolerance`), or
    None. `exact` (token ids): at most one row may differ, as a top-p boundary can where the
    kernel sums probabilities in another order."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if exact:
        wrong = int((got != want).sum())
        return f"{wrong} of {got.numel()} differ" if wrong > 1 else None
    tolerance = tolerance or _TOLERANCE.get(want.dtype, 3e-2)
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return "non-finite output"
    error = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp(min=1e-6))
    return None if error <= tolerance else f"relative RMS error {error:.3g} > {tolerance:g}"


def _attention(dm: DeviceModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Two decodes and a prefill chunk resuming on a cached prefix, over a scratch cache of
    the model's cache layout and dtype (the real cache is not touched), with attention sinks
    where the model has them."""
    spec, device, bs = dm.spec, dm.device, dm.block_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(3 * bs + 1, 1), (bs // 2, 1), (bs + 3, 2 * bs + 5)]  # (cached, new)
    blocks = [-(-(c + n) // bs) for c, n in shapes]
    order = torch.randperm(sum(blocks) + 1, generator=gen).tolist()  # scattered blocks
    tables, slots, offsets = [], [], [0]
    for (cached, new), count in zip(shapes, blocks, strict=True):
        table = [order.pop() for _ in range(count)]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(cached, cached + new)]
        offsets.append(offsets[-1] + new)
    width = max(blocks)
    layout = BatchLayout(
        num_decodes=2,
        query_start_loc=offsets,
        num_computed=[c for c, _ in shapes],
        seq_lens=[c + n for c, n in shapes],
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        slot_mapping=torch.tensor(slots, device=device),
        block_size=bs,
        sliding_window=spec.sliding_window,
    )
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dm.dtype)

    cache_shape = (sum(blocks) + 1, bs, kv_heads, dim)
    cache = [randn(*cache_shape).to(dm.kv_dtype) for _ in range(2)]
    q = randn(offsets[-1], heads, dim)
    k, v = randn(offsets[-1], kv_heads, dim), randn(offsets[-1], kv_heads, dim)
    scales = None
    if dm.kv_dtype == FP8_KV:
        scales = (torch.tensor(1.0, device=device), torch.tensor(1.0, device=device))
    sinks = randn(heads) if spec.attention_sinks else None
    outputs = []
    for backend in (dm.backend, TorchAttentionBackend()):
        k_cache, v_cache = (c.clone() for c in cache)
        metadata = backend.prepare(layout)
        outputs.append(
            backend.forward(
                q, k, v, k_cache, v_cache, metadata, dim**-0.5, kv_scales=scales, sinks=sinks
            )
        )
    return outputs[0], outputs[1]


def _use_reference(layers: list[QuantizedLinear]) -> None:
    for layer in layers:
        layer.kernel = reference_kernel


def _gemm(layer: QuantizedLinear, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(1)
    device = layer.bias.device if layer.bias is not None else next(layer.buffers()).device
    x = torch.randn(7, layer.in_features, generator=gen).to(device=device, dtype=dtype)
    return layer.kernel(layer, x), reference_kernel(layer, x)


def _moe(layer: SparseMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """One mixture-of-experts layer's experts on 24 random tokens (several per expert, runs
    across row blocks): the fused kernels, then the grouped torch path."""
    from engine.cpu.decoder_ops import DecoderOps
    from engine.model.moe_kernel import fused_experts

    weight = layer.w13
    gen = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(24, weight.shape[2], generator=gen).to(weight.device, weight.dtype)
    weights, experts = layer.route(x)
    got = fused_experts(x, layer.w13, layer.w2, weights, experts, layer.first_expert)
    return got, layer.experts(x, weights, experts, DecoderOps(False))


def _lora(dm: DeviceModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Two adapters of random weights in the first layer's q/k/v shape over two segments
    (one spanning tiles): the Triton kernels, then the torch path."""
    from engine.lora.layer_lora import LayerLoRA
    from engine.lora.segments import LoRAStep, plan
    from engine.lora.triton_kernels import KernelSegments

    slot_a, slot_parts = dm.lora.layers[0]["self_attn.qkv_proj"]
    device, dtype = slot_a.device, slot_a.dtype
    gen = torch.Generator(device="cpu").manual_seed(3)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.1).to(device=device, dtype=dtype)

    parts = [(name, row, randn(2, *b.shape[1:])) for name, row, b in slot_parts]
    weights = {"m": (randn(2, *slot_a.shape[1:]), parts)}
    segments = [(0, 0, 5), (1, 5, 24)]
    x = randn(24, slot_a.shape[1])
    got = randn(24, sum(b.shape[2] for _, _, b in slot_parts))
    want = got.clone()
    names = {name for name, _, _ in parts}
    kernel_step = LoRAStep(True, kernel=KernelSegments(segments, device), parts=names)
    torch_step = plan(segments, device)
    torch_step.parts = names
    LayerLoRA(kernel_step, weights).add("m", got, x)
    LayerLoRA(torch_step, weights).add("m", want, x)
    return got, want


def _draw(dm: DeviceModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with each filter and none, at a few temperatures, drawn by the kernel and by the
    sorted definition at the same uniforms."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    vocab = dm.spec.vocab_size
    logits = (torch.randn(8, vocab, generator=gen) * 3).to(dm.device)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
        for t, k, p, m in [
            (1.0, 0, 1.0, 0.0),
            (0.7, 50, 1.0, 0.0),
            (1.0, 0, 0.9, 0.0),
            (1.3, 0, 1.0, 0.05),
            (0.9, 20, 0.8, 0.0),
            (1.0, 5, 1.0, 0.1),
            (0.5, 0, 0.5, 0.0),
            (2.0, 100, 0.95, 0.01),
        ]
    ]
    u = torch.rand(8, generator=gen).to(dm.device)
    got = dm.sampler.draw_rows(logits, params, u)
    return got, token_draw.draw_by_sort(logits, params, u)


def _graph(graphs: DecodeGraphs, dm: DeviceModel) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step replayed, then run eagerly. Row i decodes at position i of the scratch
    block: each row writes its own slot and reads only slots written in this step (padding
    rows, which all write one slot, would race)."""
    size = max(s for s in graphs.sizes if s <= dm.block_size)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, dm.spec.vocab_size, (size,), generator=gen).tolist()
    scratch = graphs.scratch_block
    order = [
        ScheduledRequest(f"self-check-{i}", [t], i, [scratch], True, _GREEDY, 0)
        for i, t in enumerate(ids)
    ]
    replayed = graphs.replay_hidden(order)
    eager = decode_forward(
        dm.model, dm.backend, graphs.inputs.rows(size), graphs.kv_caches, dm.spec.sliding_window
    )
    return replayed, eager
