"""The device's LoRA slots: every decoder layer's adapter weights for `max_loras` adapters,
filled between steps from adapters cached on the host, and this step's rows by slot."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

import torch

from engine.core.errors import InvalidParam
from engine.core.lora_config import LoRAConfig
from engine.core.lora_slots import LoRALoad
from engine.core.outputs import ScheduledRequest
from engine.lora.adapter import LoRAAdapter, read_adapter
from engine.lora.layer_lora import LayerLoRA, ModuleWeights
from engine.lora.segments import LoRAStep
from engine.model.linear_layers import LINEARS, part_sizes
from engine.model.loader import DecoderSpec
from engine.model.sharding import Shard, SliceOf, checkpoint_slices


class LoRASlotWeights:
    def __init__(
        self,
        model: torch.nn.Module,
        spec: DecoderSpec,
        full_spec: DecoderSpec,
        config: LoRAConfig,
        shard: Shard | None,
    ) -> None:
        """Allocate the slots (zeros) of `model`, one rank's decoder of shape `spec`, and
        give each of its attention and MLP blocks their `LayerLoRA`."""
        if spec.moe is not None:
            raise InvalidParam(
                "lora", "lora: adapters on a mixture-of-experts model are not served yet"
            )
        self.full_spec, self.config = full_spec, config
        self.rank = config.max_lora_rank
        self.slices = checkpoint_slices(full_spec, shard) if shard else {}
        weight = model.norm.weight
        self.device = weight.device
        self.step = LoRAStep(transpose=model.ops.transposed)
        self.kernel = self.device.type == "cuda"  # the Triton kernels, else the torch path
        self.layers: list[dict[str, ModuleWeights]] = []
        slots, r = config.max_loras, self.rank
        for layer in model.layers:
            tensors = {}
            for module, (parts, _) in LINEARS.items():
                sizes, cols = part_sizes(spec, module)
                a = weight.new_zeros(slots, cols, len(parts) * r)
                rows = list(itertools.accumulate(sizes, initial=0))[:-1]
                bs = [
                    (part, row, weight.new_zeros(slots, r, n))
                    for part, row, n in zip(parts, rows, sizes, strict=True)
                ]
                tensors[module] = (a, bs)
            self.layers.append(tensors)
            attn = {m: t for m, t in tensors.items() if m.startswith("self_attn.")}
            mlp = {m: t for m, t in tensors.items() if m.startswith("mlp.")}
            layer.self_attn.lora = LayerLoRA(self.step, attn)
            layer.mlp.lora = LayerLoRA(self.step, mlp)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_id -> adapter, LRU
        self._host_lock = threading.Lock()
        self.slot_ids = [-1] * slots  # the lora_id each slot holds
        self.slot_parts: list[set[str]] = [set() for _ in range(slots)]  # what each adapts

    @property
    def active(self) -> bool:
        """This step has rows with adapters."""
        return self.step.active

    def begin_step(self, loads: list[LoRALoad], order: list[ScheduledRequest]) -> None:
        """Fill the slots the scheduler reassigned, then plan the adapters' share of the step
        whose packed batch holds the rows of `order` (the runner orders them by slot, so each
        adapter's tokens come in runs)."""
        for load in loads:
            self.load(load.slot, load.lora_id, self.host_adapter(load.lora_id, load.path))
        self.step.update(order, self.device, self.kernel, self.slot_parts)

    def host_adapter(self, lora_id: int, path: str) -> LoRAAdapter:
        """The adapter, from the host cache or read from `path` (checked at registration)."""
        with self._host_lock:
            adapter = self._host.get(lora_id)
        if adapter is None:
            adapter = read_adapter(path, self.full_spec, self.rank)
        self.keep(lora_id, adapter)
        return adapter

    def keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Cache an adapter on the host (most recently used; the least recently used beyond
        max_cpu_loras go). Called from the threads that register adapters too."""
        with self._host_lock:
            self._host[lora_id] = adapter
            self._host.move_to_end(lora_id)
            while len(self._host) > self.config.max_cpu_loras:
                self._host.popitem(last=False)

    def load(self, slot: int, lora_id: int, adapter: LoRAAdapter) -> None:
        r = self.rank
        for i, tensors in enumerate(self.layers):
            for a, bs in tensors.values():
                a[slot].zero_()
                for p, (part, _, b) in enumerate(bs):
                    b[slot].zero_()
                    pair = adapter.weights.get((i, part))
                    if pair is not None:
                        part_a, part_b = self._shard(pair, f"model.layers.{i}.{part}.weight")
                        rank = part_a.shape[0]
                        a[slot, :, p * r : p * r + rank].copy_(part_a.t())
                        b[slot, :rank].copy_(part_b.t())
        self.slot_ids[slot] = lora_id
        self.slot_parts[slot] = {part for _, part in adapter.weights}

    def _shard(
        self, pair: tuple[torch.Tensor, torch.Tensor], name: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B: B's rows of a column-parallel layer, A's columns of a
        row-parallel one (whose partial delta the layer's all-reduce sums)."""
        a, b = pair
        piece: SliceOf | None = self.slices.get(name)
        if piece is None:
            return a, b
        if piece.dim == 0:
            return a, b[piece.start : piece.start + piece.length]
        return a[:, piece.start : piece.start + piece.length], b
