"""Iteration-level scheduler: which tokens of which requests the next forward step computes."""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.config import SchedulerLimits
from engine.core.errors import InvalidParam
from engine.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from engine.core.request import Request, RequestStatus
from engine.core.sched.admission import admit_waiting
from engine.core.sched.inspection import check_integrity, check_request, scheduler_stats
from engine.core.sched.preemption import allocate_or_preempt
from engine.core.sched.state import SchedulerState
from engine.core.sched.verified_rows import take_verified


class Scheduler(SchedulerState):
    """Continuous (or static) batching with one token budget per step.

    Each step, running requests are served first in policy order, then waiting ones are
    admitted while the token budget, `max_num_seqs` and free blocks allow. A request's
    `num_computed_tokens` catches up to its token count in chunks no bigger than the budget,
    so chunked prefill, decode and recompute after preemption are one code path. When blocks
    run out, the worst-ranked running request goes back to the head of the waiting queue.
    """

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises InvalidParam if it could never run."""
        rid = request.request_id
        if rid in self.requests:
            raise InvalidParam("request_id", f"request_id {rid!r} is already in use")
        check_request(self, request)
        request.arrival_time = request.arrival_time or self.clock.now()
        request.seq = self.num_added
        self.num_added += 1
        self.requests[rid] = request
        self.waiting.append(request)

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
            self.end(request, status)

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
        swap_out: list[tuple[int, int]] = []

        num_decodes = num_drafts = 0
        kv = self.kv_cache
        allocate = kv.allocate_slots
        schedule_one = ScheduledRequest.of
        running = self.running
        table_of = kv.block_tables.get
        block_size = kv.block_size
        spec = self.speculator
        if spec is not None:
            spec.begin_step(running)
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            n = request.num_tokens - computed
            if n > budget:
                n = budget
            # Drafts' slots are a bonus: where they do not fit, the row decodes as usual.
            drafts = spec.drafts(request, budget) if spec and n == 1 else None
            if drafts and allocate(request, 1 + len(drafts)) is not None:
                row = ScheduledRequest.speculative(request, drafts, table_of(request.request_id))
                request.num_drafts_in_flight = row.num_drafts
                scheduled.append(row)
                num_decodes += 1
                num_drafts += row.num_drafts
                budget -= row.num_tokens
                i += 1
                continue
            table = table_of(request.request_id)
            # Most decode steps fit in the blocks held: skip the allocator (hot path).
            # NOTE: the same test as allocate_slots' "need <= 0" early return.
            if table is None or len(table) * block_size < computed + n:
                if allocate(request, n) is None:
                    made_room = allocate_or_preempt(self, request, n, i)
                    preempted += made_room.request_ids
                    swap_out += made_room.swap_out
                    if not made_room.allocated:
                        break  # the request itself was preempted; so was every one after it
                table = table_of(request.request_id)
            scheduled.append(schedule_one(request, n, table))
            if n == 1 and request.num_output_tokens:
                num_decodes += 1
            budget -= n
            i += 1

        # Admitting right after a preemption would only thrash the cache.
        admitted = admit_waiting(self, budget, allowed=not preempted)
        scheduled += admitted.scheduled
        budget = admitted.budget

        ended, self.ended_since_last_step = self.ended_since_last_step, []
        self.num_steps_total += 1
        self.steps.scheduled(len(scheduled), num_decodes)
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.limits.max_num_batched_tokens - budget,
            num_draft_tokens=num_drafts,
            finished_request_ids=ended,
            preempted_request_ids=preempted,
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=admitted.swap_in,
            kv_imports=admitted.kv_imports,
            lora_loads=self.loras.take_loads() if self.loras is not None else [],
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
            if sched.num_drafts:  # its accepted drafts, then the target's next token
                tokens = runner_output.spec_token_ids[sched.request_id]
                out = take_verified(self, request, sched.num_drafts, tokens, now)
                any_ended |= out.finished
                emit(out)
                continue
            n_new = len(sched.token_ids)
            request.num_computed_tokens += n_new
            # A block filled up this step iff the count crossed a block boundary.
            if caching and request.num_computed_tokens % block_size < n_new:
                cache_full_blocks(request)
            if not sched.sample:
                if sched.pooled:  # an embedding request's prompt is computed
                    emit(self._pooled(request, runner_output.pooled[request.request_id], now))
                    any_ended = True
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
            status = request.stop_status(token, max_model_len)
            if status is not None:
                self.end(request, status)
                any_ended = True
            reason = status.finish_reason if status else None
            emit(EngineCoreOutput(request.request_id, [token], reason))
        if any_ended:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    def executed(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """The engine's measure of a step it collected (policies and speculation read it)."""
        self.steps.executed(seconds)
        if self.speculator is not None and self.steps.last_decode_only:
            out = scheduler_output
            self.speculator.observe_step(out.num_batched_tokens, seconds, out.num_draft_tokens)

    # ---------------------------------------------------------------------- inspection
    def stats(self) -> SchedulerStats:
        return scheduler_stats(self)

    def check_integrity(self) -> None:
        check_integrity(self)

    # ------------------------------------------------------------------------- helpers
    def _pooled(self, request: Request, embedding: list[float], now: float) -> EngineCoreOutput:
        """An embedding request's prompt is computed: it ends with its pooled vector."""
        request.first_token_time = now
        status = RequestStatus.FINISHED_STOPPED
        self.end(request, status)
        return EngineCoreOutput(request.request_id, [], status.finish_reason, embedding)
