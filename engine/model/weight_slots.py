"""Where a model holds its tensors, each place one WeightSlot that reads and replaces it
(engine/cpu/host_memory.py moves them onto huge pages; benchmarks swap placements)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.cpu.packed_weights import PackedWeight


@dataclass
class WeightSlot:
    """Where a model holds one CPU tensor: an nn.Parameter (replaced through `.data`, so the
    modules sharing it share it still), a module's buffer, or a PackedWeight's data."""

    owner: object
    name: str  # the buffer's name; "data" for the others

    @property
    def tensor(self) -> torch.Tensor:
        if isinstance(self.owner, nn.Module):
            return self.owner._buffers[self.name]
        return self.owner.data

    def put(self, tensor: torch.Tensor) -> None:
        if isinstance(self.owner, nn.Module):
            self.owner._buffers[self.name] = tensor
        else:
            self.owner.data = tensor


def weight_slots(model: nn.Module) -> list[WeightSlot]:
    """Every place `model` holds a non-empty CPU tensor, each once."""
    slots: dict[tuple[int, str], WeightSlot] = {}
    for module in model.modules():
        owners: list[tuple[object, str]] = [(p, "data") for p in module._parameters.values()]
        owners += [(module, name) for name in module._buffers]
        owners += [(v, "data") for v in vars(module).values() if isinstance(v, PackedWeight)]
        for owner, name in owners:
            if owner is None or (id(owner), name) in slots:
                continue
            slot = WeightSlot(owner, name)
            t = slot.tensor
            if t is not None and t.device.type == "cpu" and t.untyped_storage().nbytes():
                slots[(id(owner), name)] = slot
    return list(slots.values())
