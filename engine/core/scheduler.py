"""Iteration-level scheduler: which tokens of which requests the next forward step computes."""

from __future__ import annotations

from bisect import insort
from collections import Counter, deque
from collections.abc import Iterable

from engine.core.clock import Clock, MonotonicClock
from engine.core.config import SchedulerConfig, SchedulerLimits
from engine.core.errors import InvalidParam
from engine.core.histogram import CumulativeHistogram
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from engine.core.request import Request, RequestStatus

# Requests per step (Prometheus buckets of the iteration batch size histogram).
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# A request that came back from preemption is spared as a victim for this many steps
# (otherwise, being the most recently admitted, it is the next one out: thrash).
RESUME_GRACE_STEPS = 4


def fcfs_key(r: Request) -> tuple:
    return (r.arrival_time, r.seq)


def priority_key(r: Request) -> tuple:
    return (r.priority, r.arrival_time, r.seq)


def sjf_key(r: Request) -> tuple:
    return (r.num_prompt_tokens + r.sampling_params.max_tokens, r.arrival_time, r.seq)


POLICY_KEYS = {"fcfs": fcfs_key, "priority": priority_key, "sjf": sjf_key}


class Scheduler:
    """Continuous (or static) batching with one token budget per step.

    Each step, running requests are served first in admission order, then waiting ones are
    admitted while the token budget, `max_num_seqs` and free blocks allow. A request's
    `num_computed_tokens` catches up to its token count in chunks no bigger than the budget,
    so chunked prefill, decode and recompute after preemption are one code path. When blocks
    run out, the most recently admitted request is preempted (its blocks freed, its progress
    reset) and put back at the head of the waiting queue.
    """

    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, clock: Clock | None = None
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.clock = clock or MonotonicClock()
        self.limits = config.limits()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ended_since_last_step: list[str] = []
        self._static_admitted = 0  # members admitted into the current static batch
        self.num_preemptions_total = 0
        self.num_steps_total = 0
        self.num_finished_total: Counter[str] = Counter()  # by finish reason
        self._last_step_num_seqs = 0
        self._last_step_num_decodes = 0
        self._last_step_decode_only = False
        # Decode-only steps as running totals: a reader that keeps the previous totals gets
        # the mean decode-step latency and batch over any period (the controller's window).
        self.decode_steps_total = 0
        self.decode_step_seconds_total = 0.0
        self.decode_step_seqs_total = 0
        self._last_step_duration_s: float | None = None
        self.batch_size_histogram = CumulativeHistogram(BATCH_SIZE_BUCKETS)
        # Policy order, best first: `running` is kept in it (the tail is preempted first) and
        # `waiting` is sorted by it (with aging) before admission, except under fcfs where
        # arrival order is kept by construction.
        self._key = POLICY_KEYS[config.scheduling_policy]
        self._num_added = 0
        self._swap_out: list[tuple[int, int]] = []
        self.num_swap_outs_total = 0

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises InvalidParam if it could never run."""
        rid = request.request_id
        if rid in self.requests:
            raise InvalidParam("request_id", f"request_id {rid!r} is already in use")
        self.check_request(request)
        request.arrival_time = request.arrival_time or self.clock.now()
        request.seq = self._num_added
        self._num_added += 1
        self.requests[rid] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """Raise InvalidParam if the request could never run here. Reads only the config."""
        if request.num_prompt_tokens < 1:
            raise InvalidParam("prompt", "prompt must contain at least one token")
        total = request.num_prompt_tokens + request.sampling_params.max_tokens
        if total > self.config.max_model_len:
            raise InvalidParam(
                "prompt",
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) = {total} exceeds max_model_len "
                f"({self.config.max_model_len})",
            )
        if self.kv_cache.blocks_needed(total) > self.kv_cache.num_blocks:
            raise InvalidParam(
                "prompt",
                f"prompt + max_tokens ({total} tokens) needs more KV blocks than the cache "
                f"holds ({self.kv_cache.num_blocks} of {self.kv_cache.block_size} tokens)",
            )

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests early (abort, stop string, error); unknown or ended ids are ignored."""
        assert status.finished, status
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._end(request, status)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def set_limits(self, limits: SchedulerLimits) -> None:
        """Change the caps from the next step on. Lowering max_num_seqs below the number of
        running requests evicts nothing; it stops admission until enough of them end."""
        self.limits = limits

    # ------------------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        num_decodes = 0
        kv = self.kv_cache
        allocate = kv.allocate_slots
        schedule_one = self._schedule_one
        running = self.running
        table_of = kv.block_tables.get
        block_size = kv.block_size
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            n = request.num_tokens - computed
            if n > budget:
                n = budget
            table = table_of(request.request_id)
            # Most decode steps fit in the blocks held: skip the allocator (hot path).
            # NOTE: the same test as allocate_slots' "need <= 0" early return.
            if table is None or len(table) * block_size < computed + n:
                if allocate(request, n) is None and not self._allocate_or_preempt(
                    request, n, preempted, i
                ):
                    break  # the request itself was preempted; so was every one after it
                table = table_of(request.request_id)
            scheduled.append(schedule_one(request, n, table))
            if n == 1 and request.num_output_tokens:
                num_decodes += 1
            budget -= n
            i += 1

        if self.config.batching == "static" and not self.running:
            self._static_admitted = 0
        # Admitting right after a preemption would only thrash the cache.
        if self.config.scheduling_policy != "fcfs" and len(self.waiting) > 1 and budget > 0:
            self._order_waiting()
        while not preempted and self.waiting and budget > 0 and self._may_admit():
            request = self.waiting[0]
            if request.status == RequestStatus.SWAPPED:  # its KV comes back from the host
                n = min(request.num_tokens - request.num_computed_tokens, budget)
                copies = kv.swap_in(request, n)
                if copies is None:
                    break
                swap_in += copies
            else:  # nothing computed (new, or preempted and reset): try the prefix cache
                hit = kv.match_prefix(request)
                num_cached = len(hit) * kv.block_size
                n = min(request.num_tokens - num_cached, budget)
                if not kv.admit(request, hit, n):
                    break
                request.num_computed_tokens = num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock.now()
            if request.num_preemptions:
                request.resumed_at_step = self.num_steps_total
            insort(self.running, request, key=self._key)
            self._static_admitted += 1
            scheduled.append(self._schedule_one(request, n, kv.block_ids(request.request_id)))
            budget -= n

        ended, self._ended_since_last_step = self._ended_since_last_step, []
        self.num_steps_total += 1
        self._last_step_num_seqs = len(scheduled)
        if scheduled:
            self.batch_size_histogram.observe(len(scheduled))
        self._last_step_num_decodes = num_decodes
        self._last_step_decode_only = bool(scheduled) and num_decodes == len(scheduled)
        self._last_step_duration_s = None
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.limits.max_num_batched_tokens - budget,
            finished_request_ids=ended,
            preempted_request_ids=preempted,
            blocks_to_swap_out=self._swap_out,
            blocks_to_swap_in=swap_in,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request by what the step computed and sampled."""
        outputs: list[EngineCoreOutput] = []
        any_ended = False
        now = self.clock.now()
        requests = self.requests
        sampled = runner_output.sampled_token_ids
        running = RequestStatus.RUNNING
        max_model_len = self.config.max_model_len
        caching = self.kv_cache.enable_prefix_caching
        cache_full_blocks = self.kv_cache.cache_full_blocks
        block_size = self.kv_cache.block_size
        emit = outputs.append
        for sched in scheduler_output.scheduled:
            request = requests.get(sched.request_id)
            if request is None or request.status is not running:
                continue  # ended while the step ran
            n_new = len(sched.token_ids)
            request.num_computed_tokens += n_new
            # A block filled up this step iff the count crossed a block boundary.
            if caching and request.num_computed_tokens % block_size < n_new:
                cache_full_blocks(request)
            if not sched.sample:
                continue
            token = sampled[sched.request_id]
            request.all_token_ids.append(token)
            request.num_tokens += 1
            request.num_output_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            # The common case, inlined: not a stop token and below both length limits.
            if (
                request.num_output_tokens < request.sampling_params.max_tokens
                and request.num_tokens < max_model_len
                and token not in request.stop_token_ids
            ):
                emit(EngineCoreOutput(request.request_id, [token], None))
                continue
            status = self._stop_status(request, token)
            if status is not None:
                self._end(request, status)
                any_ended = True
            outputs.append(
                EngineCoreOutput(
                    request.request_id, [token], status.finish_reason if status else None
                )
            )
        if any_ended:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """The runner raised on this step: end its requests with an error, keep the rest."""
        ids = [s.request_id for s in scheduler_output.scheduled if s.request_id in self.requests]
        self.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        return [
            EngineCoreOutput(rid, [], RequestStatus.FINISHED_ERROR.finish_reason) for rid in ids
        ]

    # ---------------------------------------------------------------------- inspection
    def record_step_duration(self, seconds: float) -> None:
        """The engine's measure of the step just executed (policies read it from stats)."""
        self._last_step_duration_s = seconds
        if self._last_step_decode_only:
            self.decode_steps_total += 1
            self.decode_step_seconds_total += seconds
            self.decode_step_seqs_total += self._last_step_num_seqs

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=self.kv_cache.num_free_blocks,
            num_used_blocks=self.kv_cache.num_used_blocks,
            num_total_blocks=self.kv_cache.num_blocks,
            kv_usage=self.kv_cache.usage(),
            max_num_seqs=self.limits.max_num_seqs,
            max_num_batched_tokens=self.limits.max_num_batched_tokens,
            num_preemptions_total=self.num_preemptions_total,
            num_steps_total=self.num_steps_total,
            num_finished_total=dict(self.num_finished_total),
            num_decoding=self._last_step_num_decodes,
            last_step_num_seqs=self._last_step_num_seqs,
            last_step_decode_only=self._last_step_decode_only,
            last_step_duration_s=self._last_step_duration_s,
            decode_steps_total=self.decode_steps_total,
            decode_step_seconds_total=self.decode_step_seconds_total,
            decode_step_seqs_total=self.decode_step_seqs_total,
            prefix_cache_queries=self.kv_cache.prefix_queries,
            prefix_cache_hits=self.kv_cache.prefix_hits,
            num_swapped=len(self.kv_cache.swapped_ids()),
            num_swap_outs_total=self.num_swap_outs_total,
            num_free_host_blocks=self.kv_cache.num_free_host_blocks,
        )

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert live == set(self.requests), "request index out of step with the queues"
        assert len(live) == len(self.running) + len(self.waiting), "a request is queued twice"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, r
        for r in self.waiting:
            assert r.status in (
                RequestStatus.WAITING,
                RequestStatus.PREEMPTED,
                RequestStatus.SWAPPED,
            ), r
            if r.status == RequestStatus.PREEMPTED:
                assert r.num_computed_tokens == 0, r
        swapped = {r.request_id for r in self.waiting if r.status == RequestStatus.SWAPPED}
        assert self.kv_cache.swapped_ids() == swapped, "host tables out of step with requests"
        # NOTE: only running requests hold blocks; waiting and preempted ones hold none.
        assert self.kv_cache.request_ids() == {r.request_id for r in self.running}, "orphan table"

    # ------------------------------------------------------------------------- helpers
    def _may_admit(self) -> bool:
        if len(self.running) >= self.limits.max_num_seqs:
            return False
        if self.config.batching == "static":
            return self._static_admitted < self.limits.max_num_seqs
        return True

    def _allocate_or_preempt(
        self, request: Request, n: int, preempted: list[str], position: int
    ) -> bool:
        """Allocate for `request` (at `position` in `running`), preempting requests ranked
        after it, worst first, as needed. Returns False if `request` itself had to go."""
        while self.kv_cache.allocate_slots(request, n) is None:
            victim = self._pick_victim(position)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _pick_victim(self, position: int) -> Request:
        """The worst-ranked running request not yet scheduled this step (after `position`),
        sparing those that just came back from a preemption while another will do; the
        request at `position` itself when none is left."""
        running = self.running
        recent = self.num_steps_total - RESUME_GRACE_STEPS
        for j in range(len(running) - 1, position, -1):
            if running[j].resumed_at_step < recent:
                return running.pop(j)
        return running.pop() if len(running) - 1 > position else running.pop(position)

    def _order_waiting(self) -> None:
        """Policy order with aging: whoever has waited aging_s or more goes first (oldest
        first), then the rest by the policy's key."""
        oldest = self.clock.now() - self.config.aging_s
        key = self._key
        self.waiting = deque(
            sorted(
                self.waiting,
                key=lambda r: (
                    (0, r.arrival_time, r.seq) if r.arrival_time <= oldest else (1, *key(r))
                ),
            )
        )

    def _preempt(self, request: Request) -> None:
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        if self.config.preemption_mode == "swap":
            copies = self.kv_cache.swap_out(request)
            if copies is not None:  # KV kept on the host; progress kept
                self._swap_out += copies
                request.status = RequestStatus.SWAPPED
                self.num_swap_outs_total += 1
                return
        # Recompute (or swap with a full host pool): drop the KV and start over.
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0

    def _schedule_one(self, request: Request, n: int, block_ids: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        sample = start + n == request.num_tokens
        params = request.sampling_params
        banned: tuple[int, ...] = ()
        if sample and request.num_output_tokens < params.min_tokens:
            banned = tuple(sorted(request.stop_token_ids))
        return ScheduledRequest(
            request.request_id,
            request.all_token_ids[start : start + n],
            start,
            block_ids,
            sample,
            params,
            request.num_output_tokens,
            banned,
        )

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        n_out = request.num_output_tokens
        if n_out >= params.min_tokens and token in request.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _end(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.num_finished_total[status.value] += 1
        self.kv_cache.free(request.request_id)
        del self.requests[request.request_id]
        self._ended_since_last_step.append(request.request_id)
