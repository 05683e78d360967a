"""What a scheduler holds between steps (pure Python): its queues and request index, its KV
cache, adapter slots and speculator, its caps and counters; and the few acts on them that
admission, preemption, verification, the decode cohort and the step launched ahead share:
end a request, whether one more may be admitted, release a request's adapter slot, pick a
preemption victim. The Scheduler (engine/core/sched/scheduler.py) is this state with its
step."""

from __future__ import annotations

from collections import Counter, deque

from engine.core.clock import Clock, MonotonicClock
from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.lora_slots import LoRASlots
from engine.core.request import Request, RequestStatus
from engine.core.sched.request_order import POLICY_KEYS, RESUME_GRACE_STEPS, pick_victim
from engine.core.sched.step_stats import StepStats
from engine.core.speculator import Speculator


class SchedulerState:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        clock: Clock | None = None,
        speculator: Speculator | None = None,
        loras: LoRASlots | None = None,
    ) -> None:
        self.config = config
        self.loras = loras  # the device's LoRA adapter slots (LoRA enabled)
        self.speculator = speculator  # drafts for decoding requests (speculative decoding)
        self.kv_cache = kv_cache
        self.clock = clock or MonotonicClock()
        self.limits = config.limits()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_added = 0  # requests ever added: each one's arrival order (Request.seq)
        # Ended since the last step was scheduled: the runner forgets their rows' state.
        self.ended_since_last_step: list[str] = []
        self.static_admitted = 0  # members admitted into the current static batch
        self.num_preemptions_total = 0
        self.num_steps_total = 0
        self.num_finished_total: Counter[str] = Counter()  # by finish reason
        self.num_swap_outs_total = 0
        self.steps = StepStats()
        # Policy order, best first: `running` is kept in it (the tail goes out first); `waiting`
        # is sorted by it with aging before admission (under fcfs arrival order already is).
        self.order_key = POLICY_KEYS[config.scheduling_policy]

    def may_admit(self) -> bool:
        """Whether one more request may run (max_num_seqs; a static batch admits no more
        than it once held until it empties)."""
        if len(self.running) >= self.limits.max_num_seqs:
            return False
        if self.config.batching == "static":
            return self.static_admitted < self.limits.max_num_seqs
        return True

    def pick_victim(self, position: int) -> Request:
        """The running request to preempt to make room for the one at `position`."""
        return pick_victim(self.running, position, self.num_steps_total - RESUME_GRACE_STEPS)

    def release_lora(self, request: Request) -> None:
        """A running request leaves the running set: its adapter's slot may go to another."""
        if self.loras is not None and request.lora_slot >= 0:
            self.loras.release(request.lora)
            request.lora_slot = -1

    def end(self, request: Request, status: RequestStatus) -> None:
        """A request ends with `status`: its blocks, slot and speculator state go back, and it
        leaves the index (the caller takes it out of its queue)."""
        self.release_lora(request)
        request.status = status
        self.num_finished_total[status.value] += 1
        self.kv_cache.free(request.request_id)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        del self.requests[request.request_id]
        self.ended_since_last_step.append(request.request_id)
