"""A rank's model on its device, with what running a step of it takes besides the KV cache:
the parts of a runner that the decode graphs, the KV budget and the GPU self-check read. A
plain record of references the runner makes when it hands them over; they change nothing of
the runner's (the self-check returns its verdicts, and the runner applies them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.core.outputs import ScheduledRequest
from engine.lora.slot_weights import LoRASlotWeights
from engine.model.loader import DecoderSpec
from engine.runner.packed_inputs import packed_inputs
from engine.sampling.sampler import Sampler


@dataclass(frozen=True)
class DeviceModel:
    model: Any  # the decoder (engine/model/decoder.py), its weights on `device`
    spec: DecoderSpec  # this rank's shape
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int
    backend: AttentionBackend
    sampler: Sampler
    lora: LoRASlotWeights | None
    world_size: int  # tensor-parallel ranks sharing the replica's KV budget

    def bytes_per_block(self) -> int:
        """One KV block's bytes, keys and values of every layer."""
        s = self.spec
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem

    def prepare_inputs(
        self, order: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, BatchLayout, torch.Tensor]:
        """A step's flat inputs: token ids, positions, the attention layout, logit rows."""
        return packed_inputs(order, self.block_size, self.spec.sliding_window, self.device)


KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values) by block
