"""Steady decoders advanced together: the simulator's fast path through a busy scheduler.

In a busy engine most rows of a step decode one more token and only a few change: one is
admitted, one ends, one needs a block. A DecodeCohort holds the running requests that
decode steadily (no prompt left, no drafts, a token that never stops them, so their end is
known in advance: max_tokens or max_model_len) and moves them by one shared step counter
instead of one by one. A member's counters are brought up to date only when it takes a
block (at the step the scheduler would allocate it), ends (at its known step), or the
cohort is left. The decisions stay the scheduler's: admission is its own code
(admission.py) against its KV manager, whose pool counts each member's new block at the
step the scheduler would take it (BlockPool.hold; which block it is gets chosen when the
member leaves, as nothing in a simulation reads block ids), ends go through
`SchedulerState.end`, admitted rows through `update_from_output`, and every step is counted in
its step statistics as `schedule` and the engine would count it.

A step the cohort cannot take as the scheduler would (too few free blocks: a preemption;
a partial prefill left in the batch) makes the caller leave it (`leave`, which brings
every member up to date) and take the scheduler's own step. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from engine.core.policy import ExternalLimits
from engine.core.request import Request, RequestStatus
from engine.core.sched.admission import Admitted, admit_waiting

if TYPE_CHECKING:
    from engine.core.clock import Clock
    from engine.core.sched.scheduler import Scheduler

# Prices a step by its sums (rows, tokens, sampled, attended, context: as
# CostModelRunner.run_step reads them), moving the clock to its end; returns the clock.
PriceStep = Callable[[int, int, int, int, int], float]
# After each step: its end, its number of rows, the requests it ended.
StepDone = Callable[[float, int, list[Request]], None]


class DecodeCohort:
    def __init__(self, scheduler: Scheduler, clock: Clock, token_id: int) -> None:
        """`token_id`: the token every step samples (the simulator's runner)."""
        self.s = scheduler
        self.clock = clock
        self.token = token_id
        self.active = False
        self.step_no = 0
        self.synced: dict[str, int] = {}  # member -> the step_no its counters are as of
        self.allocs: dict[int, list[Request]] = {}  # step_no -> members taking a block in it
        self.ends: dict[int, list[Request]] = {}  # step_no -> members it ends
        self.context = 0  # the members' num_computed_tokens, summed as of step_no
        self.held: dict[str, int] = {}  # member -> blocks the pool holds for it (BlockPool.hold)

    @staticmethod
    def fits(s: Scheduler, policy: object) -> bool:
        """Whether a cohort can stand in for `s`'s steps: first-come-first-served, no
        drafts, adapters or prefix cache, and limits that change only between calls of
        `run` (none, or set from outside)."""
        return (
            s.config.scheduling_policy == "fcfs"
            and s.speculator is None
            and s.loras is None
            and not s.kv_cache.enable_prefix_caching
            and (policy is None or isinstance(policy, ExternalLimits))
        )

    def enter(self) -> bool:
        """Take every running request as a member, if each decodes steadily."""
        if not all(self._steady(r) for r in self.s.running):
            return False
        self.active = True
        for r in self.s.running:
            self._join(r)
        return True

    def leave(self) -> None:
        """Bring every member up to date and let them go (the scheduler steps next)."""
        kv = self.s.kv_cache
        for r in self.s.running:
            if r.request_id in self.synced:
                self._sync(r)
                n = self.held[r.request_id]
                if n:
                    kv.append_held(r, n)
        self.synced.clear()
        self.held.clear()
        self.allocs.clear()
        self.ends.clear()
        self.context = 0
        self.active = False

    def run(self, until_s: float, price: PriceStep, done: StepDone) -> int:
        """Take the steps that start before `until_s` while the cohort can: how many. Where
        it stops short of `until_s` it leaves, and the scheduler takes the next step."""
        taken, stopped = self._run(until_s, price, done)
        if stopped:
            self.leave()
        return taken

    def _run(self, until_s: float, price: PriceStep, done: StepDone) -> tuple[int, bool]:
        s, kv, clock = self.s, self.s.kv_cache, self.clock
        bs, max_len, token = kv.block_size, s.config.max_model_len, self.token
        running = RequestStatus.RUNNING
        pool, held = kv.pool, self.held
        taken = 0
        while clock.now() < until_s:
            j, members = self.step_no, len(s.running)
            budget = s.limits.max_num_batched_tokens - members
            if budget < 0:
                return taken, True
            crossing = self.allocs.get(j)
            if crossing:  # members whose next token starts a block (ended ones left out)
                crossing = [r for r in crossing if r.status is running]
                # Counted now, as the scheduler takes them; chosen when the member leaves.
                if not pool.hold(len(crossing)):
                    return taken, True  # the scheduler would preempt
                for r in crossing:
                    held[r.request_id] += 1
                del self.allocs[j]
                later = self.allocs.get(j + bs)
                if later is None:
                    self.allocs[j + bs] = crossing
                else:
                    later += crossing
            # An empty queue admits nothing (and a static batch restarts on the next arrival).
            admitted = admit_waiting(s, budget) if s.waiting else Admitted()
            if admitted.swap_in:
                raise AssertionError("a simulated scheduler swapped")
            rows = admitted.scheduled
            if not members and not rows:
                return taken, True  # the scheduler's own step reports it
            # Each member attends to its context and its new token (engine/runner/cost_model).
            attended = context = self.context + members
            tokens = sampled = members
            for row in rows:
                n, start = len(row.token_ids), row.num_computed_tokens
                attended += n * start + n * (n + 1) // 2
                context += start + n
                tokens += n
                sampled += row.sample
            started = clock.now()
            ended = price(members + len(rows), tokens, sampled, attended, context)
            s.ended_since_last_step = []
            s.num_steps_total += 1
            s.steps.scheduled(members + len(rows), members)
            s.steps.executed(ended - started)
            self.step_no += 1
            self.context += members
            finished = self._end_members(j, max_len)
            partial = False
            if rows:
                admitted = [s.requests[row.request_id] for row in rows]
                sampled_ids = {row.request_id: token for row in rows if row.sample}
                s.update_from_output(
                    SchedulerOutput(rows, tokens - members), ModelRunnerOutput(sampled_ids)
                )
                for r in admitted:
                    if r.status is not running:
                        finished.append(r)
                    elif self._steady(r):
                        self._join(r)
                    else:
                        partial = True
            taken += 1
            done(ended, members + len(rows), finished)
            if partial:  # a prompt not done: the scheduler steps it
                return taken, True
        return taken, False

    # ------------------------------------------------------------------------- helpers
    def _steady(self, r: Request) -> bool:
        return (
            r.num_tokens - r.num_computed_tokens == 1
            and r.num_output_tokens > 0
            and not r.num_drafts_in_flight
            and self.token not in r.stop_token_ids
        )

    def _join(self, r: Request) -> None:
        j, kv = self.step_no, self.s.kv_cache
        self.synced[r.request_id] = j
        self.held[r.request_id] = 0
        self.context += r.num_computed_tokens
        room = len(kv.block_tables.get(r.request_id, ())) * kv.block_size
        self.allocs.setdefault(j + room - r.num_computed_tokens, []).append(r)
        steps_left = min(
            r.sampling_params.max_tokens - r.num_output_tokens,
            self.s.config.max_model_len - r.num_tokens,
        )
        self.ends.setdefault(j + steps_left - 1, []).append(r)

    def _sync(self, r: Request) -> None:
        d = self.step_no - self.synced[r.request_id]
        if d:
            r.num_computed_tokens += d
            r.num_tokens += d
            r.num_output_tokens += d
            r.all_token_ids.extend([self.token] * d)
            self.synced[r.request_id] = self.step_no

    def _end_members(self, j: int, max_len: int) -> list[Request]:
        """The members whose last step was step j, ended as `update_from_output` ends them."""
        ending = self.ends.pop(j, None)
        if not ending:
            return []
        s = self.s
        for r in ending:
            self._sync(r)
            del self.synced[r.request_id]
            s.kv_cache.pool.unhold(self.held.pop(r.request_id))
            self.context -= r.num_computed_tokens
            status = r.stop_status(self.token, max_len)
            if status is None:
                raise AssertionError(f"{r.request_id}: did not end at its last step")
            s.end(r, status)
            s.running.remove(r)  # the order of the rest stays (the scheduler's policy order)
        return list(ending)
