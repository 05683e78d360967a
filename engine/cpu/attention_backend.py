"""The `cpu` attention backend: the native paged kernels (engine/cpu/csrc) on CPU float32.

Decodes run as one native call that reads K/V straight from the paged cache; prefill chunks
as one native flash-style call for all of them (AVX2 + FMA or AVX-512 hosts). Whatever a
kernel cannot take (no compiler, another dtype or device, a head size the prefill kernel does
not tile, no scratch memory, a sliding window, attention sinks) runs the torch reference
instead, row for row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.attention.torch_backend import (
    LayerAttention,
    TorchAttentionBackend,
    TorchAttentionMetadata,
)
from engine.cpu.attention_kernels import (
    PrefillChunks,
    load_native_decode,
    load_native_prefill,
    native_decode_supported,
    native_prefill_supported,
    paged_decode_attention,
    paged_prefill_attention,
)


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    native_prefills: PrefillChunks | None = None  # the prefill chunks as the kernel reads them


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    supports_fp8_kv = False  # the native kernels read float32 caches
    supports_sinks = True  # the layers with sinks run the torch reference
    # CPU steps run eagerly: no graph code runs there.
    supports_graphs = False
    decode_metadata = AttentionBackend.decode_metadata

    def __init__(self) -> None:
        self._decode_lib = load_native_decode()
        self._prefill_lib = load_native_prefill()

    @property
    def available(self) -> bool:
        """True where the kernels built here (else every step runs the torch reference)."""
        return self._decode_lib is not None

    def prepare(self, layout: BatchLayout) -> CpuAttentionMetadata:
        base = super().prepare(layout)
        native = None
        nd = layout.num_decodes
        if (
            base.prefills
            and self._prefill_lib is not None
            and layout.block_table.is_cpu
            and layout.sliding_window is None
        ):
            rows = range(nd, len(layout.seq_lens))
            native = PrefillChunks(
                q_start=torch.tensor([layout.query_start_loc[i] for i in rows]),
                num_tokens=torch.tensor([p.end - p.start for p in base.prefills]),
                num_cached=torch.tensor([layout.num_computed[i] for i in rows]),
                block_table=layout.block_table[nd:].contiguous(),
            )
        return CpuAttentionMetadata(**vars(base), native_prefills=native)

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        m: CpuAttentionMetadata,
        scale: float,
        out: torch.Tensor,
        layer: LayerAttention,
    ) -> None:
        native = self._decode_lib is not None and layer.window is None and layer.sinks is None
        if not native or not native_decode_supported(q, k_cache):
            super().decode(q, k_cache, v_cache, m, scale, out, layer)
            return
        nd = m.num_decodes
        paged_decode_attention(
            self._decode_lib,
            q[:nd],
            k_cache,
            v_cache,
            m.decode_block_table,
            m.decode_seq_lens,
            scale,
            out=out[:nd],
        )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        m: CpuAttentionMetadata,
        scale: float,
        out: torch.Tensor,
        layer: LayerAttention,
    ) -> None:
        if (
            m.native_prefills is not None
            and layer.window is None
            and layer.sinks is None
            and native_prefill_supported(q, k_cache)
            and paged_prefill_attention(
                self._prefill_lib, q, k_cache, v_cache, m.native_prefills, out, scale
            )
        ):
            return
        super().prefill(q, k, v, k_cache, v_cache, m, scale, out, layer)
