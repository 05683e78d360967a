"""A sequence's blocks out of one paged KV cache and into another (engine/core/sequence_kv.py).

Blocks leave as bytes: one buffer [layers, 2, blocks, block_size, kv_heads, head_bytes]
whatever the cache's dtype (numpy has no bfloat16 or FP8), a tensor where the cache is (the
direct link between replicas, engine/runner/kv_link.py, sends it from there) or a numpy
array on the host (`on_host`: Ray's object store moves it without a copy into Python
objects). An FP8 cache's bytes mean something only with their scales: a target whose scales
are not measured yet takes the source's, one with the same scales writes the bytes as they
are, and one with other scales re-quantizes them (the one case where the tokens may differ
from an undisturbed run's). With tensor parallelism the buffer holds every head (rank 0
gathers them) and each rank writes its share.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from engine.attention.base import FP8_KV, dequantize_kv, quantize_kv, stored
from engine.core.sequence_kv import SequenceKV

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) of every layer


def read_kv(
    caches: KVCaches, block_ids: list[int], token_ids: list[int], block_size: int, model: nn.Module
) -> SequenceKV:
    """The KV of `token_ids` (the sequence's first tokens), held in `block_ids`: a copy of
    the blocks' bytes on the cache's device."""
    device = caches[0][0].device
    index = torch.tensor(block_ids, device=device)
    # [layers * 2, blocks, block_size, kv_heads, head_dim] -> bytes on the last axis
    blocks = torch.stack([stored(c).index_select(0, index) for kv in caches for c in kv])
    data = blocks.view(torch.uint8).reshape(len(caches), 2, *blocks.shape[1:-1], -1)
    if device.type == "cuda":  # other threads (and streams) send it, once it is written
        torch.cuda.current_stream(device).synchronize()
    dtype = caches[0][0].dtype
    return SequenceKV(
        list(token_ids),
        block_size,
        str(dtype).removeprefix("torch."),
        data,
        _scales(model) if dtype == FP8_KV else None,
    )


def on_host(kv: SequenceKV) -> SequenceKV:
    """`kv` with its bytes in a numpy array (for Ray's object store)."""
    if not isinstance(kv.data, torch.Tensor):
        return kv
    return dataclasses.replace(kv, data=kv.data.cpu().numpy())


def refusal(kv: SequenceKV, caches: KVCaches, block_size: int, world: int = 1) -> str | None:
    """Why `kv` cannot go into these caches as it is (another model or layout), or None.
    `world`: the tensor-parallel ranks that share the heads (each cache holds its share;
    `kv` holds them all)."""
    keys = caches[0][0]
    heads = keys.shape[2] * world
    want = (len(caches), 2, kv.num_blocks, block_size, heads, _head_bytes(keys))
    dtype = str(keys.dtype).removeprefix("torch.")
    if kv.data is None:
        return "it carries no KV tensors (an emulated engine's)"
    if kv.block_size != block_size or kv.cache_dtype != dtype:
        theirs = f"{kv.cache_dtype} in blocks of {kv.block_size}"
        return f"its cache is {theirs}, here {dtype} in blocks of {block_size}"
    if tuple(kv.data.shape) != want:
        return f"its blocks are shaped {tuple(kv.data.shape)}, here {want}"
    if keys.dtype == FP8_KV and world > 1:
        return "FP8 KV across tensor-parallel ranks (each rank measures its own scales)"
    if keys.dtype == FP8_KV and (kv.scales is None or len(kv.scales) != len(caches)):
        return "its FP8 blocks come without their scales"
    return None


def write_kv(
    caches: KVCaches,
    kv: SequenceKV,
    block_ids: list[int],
    model: nn.Module,
    first_head: int = 0,
) -> None:
    """Write `kv` (which `refusal` accepted) into `block_ids` of `caches`: its heads from
    `first_head` on, as many as the caches hold (a tensor-parallel rank's share)."""
    device = caches[0][0].device
    index = torch.tensor(block_ids, device=device)
    with warnings.catch_warnings():  # read-only from the object store: only read here
        warnings.simplefilter("ignore", UserWarning)
        data = kv.data if isinstance(kv.data, torch.Tensor) else torch.from_numpy(kv.data)
    layers = _attention_layers(model)
    fp8 = caches[0][0].dtype == FP8_KV
    if fp8:
        _take_scales(layers, kv)
    for i, layer_caches in enumerate(caches):
        for j, cache in enumerate(layer_caches):
            target = stored(cache)
            heads = data[i, j, :, :, first_head : first_head + target.shape[2]]
            blocks = heads.contiguous().to(device).view(target.dtype)
            ours = layers[i].kv_scales[j] if fp8 else None
            if ours is not None and (theirs := kv.scales[i][j]) != float(ours):
                source_scale = torch.tensor(theirs, device=device)
                values = dequantize_kv(blocks.view(FP8_KV), source_scale, torch.float32)
                blocks = quantize_kv(values, ours).view(torch.uint8)
            target.index_copy_(0, index, blocks)


def _head_bytes(cache: torch.Tensor) -> int:
    return cache.shape[-1] * cache.element_size()


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in model.layers]


def _scales(model: nn.Module) -> tuple[tuple[float, float], ...]:
    return tuple((float(a.kv_scales[0]), float(a.kv_scales[1])) for a in _attention_layers(model))


def _take_scales(layers: list[nn.Module], kv: SequenceKV) -> None:
    """Layers still waiting to measure their scales take the source's (so the bytes are
    written as they are, and later tokens are quantized as they were there)."""
    assert kv.scales is not None
    for attention, (k, v) in zip(layers, kv.scales, strict=True):
        if attention.calculate_kv_scales:
            attention.kv_scales[0].fill_(k)
            attention.kv_scales[1].fill_(v)
            attention.calculate_kv_scales = False
