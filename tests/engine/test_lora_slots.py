"""The device's LoRA slots: adapters read by running requests are never evicted; idle ones
go least recently used first; a request whose adapter finds no slot waits and lets the
requests behind it go ahead."""

from __future__ import annotations

from engine.core.lora_slots import LoRALoad, LoRARequest, LoRASlots
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from tests.engine.helpers import make_scheduler

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", 1))


def test_idle_adapters_are_evicted_least_recently_used_first():
    slots = LoRASlots(2)
    assert slots.acquire(A) == 0 and slots.acquire(B) == 1 and slots.acquire(None) == -1
    assert slots.take_loads() == [LoRALoad(0, 1, A.path), LoRALoad(1, 2, B.path)]
    assert not slots.can_acquire(C)  # both read by running requests
    slots.release(B)
    slots.release(A)  # both idle now, B the least recently used
    assert slots.acquire(C) == 1
    assert slots.acquire(A) == 0 and slots.take_loads() == [LoRALoad(1, 3, C.path)]
    assert not slots.can_acquire(B)
    slots.check()


def test_a_request_without_a_slot_waits_while_others_go_ahead():
    scheduler = make_scheduler(num_blocks=64, block_size=4)
    scheduler.loras = LoRASlots(1)
    params = SamplingParams(max_tokens=4)
    requests = [
        Request("a", [1, 2, 3], params, lora=A),
        Request("b", [1, 2, 3], params, lora=B),  # no slot while "a" runs
        Request("base", [1, 2, 3], params),
        Request("a2", [4, 5, 6], params, lora=A),
    ]
    for r in requests:
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "base", "a2"]
    assert [s.lora_slot for s in out.scheduled] == [0, -1, 0]
    assert out.lora_loads == [LoRALoad(0, A.lora_id, A.path)]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    scheduler.check_integrity()
    scheduler.finish_requests(["a", "a2"], RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()  # slot 0 is idle now: "b" takes it
    assert [s.request_id for s in out.scheduled if s.lora_slot == 0] == ["b"]
    assert out.lora_loads == [LoRALoad(0, B.lora_id, B.path)]
    scheduler.check_integrity()
