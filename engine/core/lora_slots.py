"""Which LoRA adapters the device holds, in its fixed slots (pure Python).

The scheduler admits a request with an adapter only when the adapter holds a slot or can
take one: a free slot, else the least recently used slot that no running request reads. A
slot given to another adapter is reloaded by the runner before the step that first reads it
(`SchedulerOutput.lora_loads`), between steps, so other requests never wait on a load.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: its served name, the engine's id of this
    registration (a name registered again is another adapter) and its directory."""

    name: str
    lora_id: int
    path: str


@dataclass(frozen=True)
class LoRALoad:
    """Load the adapter `lora_id` from `path` into device slot `slot` before the step."""

    slot: int
    lora_id: int
    path: str


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: dict[int, int] = {}  # lora_id -> slot
        self._names: dict[int, str] = {}  # lora_id -> served name, of those in slots
        self._users: Counter[int] = Counter()  # lora_id -> running requests that read it
        self._idle: OrderedDict[int, None] = OrderedDict()  # held, unread: least recent first
        self._free = list(range(num_slots - 1, -1, -1))
        self._loads: list[LoRALoad] = []
        self.num_loads_total = 0

    def can_acquire(self, lora: LoRARequest | None) -> bool:
        return lora is None or lora.lora_id in self._slot_of or bool(self._free or self._idle)

    def acquire(self, lora: LoRARequest | None) -> int:
        """The slot a request admitted now reads (-1: none); call after `can_acquire`."""
        if lora is None:
            return -1
        lid = lora.lora_id
        slot = self._slot_of.get(lid)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                evicted, _ = self._idle.popitem(last=False)
                slot = self._slot_of.pop(evicted)
                del self._names[evicted]
            self._slot_of[lid] = slot
            self._names[lid] = lora.name
            self._loads.append(LoRALoad(slot, lid, lora.path))
            self.num_loads_total += 1
        self._idle.pop(lid, None)
        self._users[lid] += 1
        return slot

    def release(self, lora: LoRARequest | None) -> None:
        """A request that held a slot left the running set (ended or preempted)."""
        if lora is None:
            return
        lid = lora.lora_id
        self._users[lid] -= 1
        if self._users[lid] <= 0:
            del self._users[lid]
            self._idle[lid] = None

    def take_loads(self) -> list[LoRALoad]:
        loads, self._loads = self._loads, []
        return loads

    def held_names(self) -> list[str]:
        """The names of the adapters in slots (a request for one starts without a load)."""
        return list(self._names.values())

    def check(self) -> None:
        held = set(self._slot_of.values())
        assert len(held) == len(self._slot_of), "two adapters in one slot"
        assert held.isdisjoint(self._free), "a held slot is also free"
        assert len(held) + len(self._free) == self.num_slots, "a slot is lost"
        assert set(self._idle).isdisjoint(self._users), "an adapter both idle and read"
