"""One simulated engine replica: the real Scheduler and EngineCore on its own virtual clock,
a CostModelRunner pricing each step, and the records of the requests it served."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cluster.batching import make_policy
from cluster.conversations import prompt_tokens
from cluster.request_records import RequestRecord
from cluster.sim_config import SimConfig
from cluster.workload import SimRequest
from engine.core.clock import VirtualClock
from engine.core.engine_core import EngineCore
from engine.core.fixed_proposers import SimulatedDrafts
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.lora_slots import LoRARequest, LoRASlots
from engine.core.policy import BatchingPolicy, ExternalLimits
from engine.core.request import Request, RequestStatus, Resume
from engine.core.sampling_params import SamplingParams
from engine.core.sched.decode_cohort import DecodeCohort
from engine.core.sched.scheduler import Scheduler
from engine.core.sequence_kv import SequenceKV
from engine.core.speculator import Speculator
from engine.runner.cost_model import CostModelRunner


@dataclass(frozen=True)
class MovedSequence:
    """A sequence a replica moved out, to go on at another (migration on drain): what was
    asked, the tokens it made so far, and how many tokens' KV goes with it."""

    req: SimRequest
    prompt: list[int]
    output_token_ids: list[int]
    num_kv_tokens: int  # 0: nothing computed (or swapped out): computed again where it goes


class SimReplica:
    """One engine replica on its own virtual clock: the real Scheduler and EngineCore, with
    a CostModelRunner pricing each step. The single-replica Simulator drives one; the
    cluster simulator drives many on a shared timeline."""

    def __init__(
        self,
        config: SimConfig,
        records: dict[str, RequestRecord],
        start_s: float = 0.0,
        controlled: bool = False,
        on_finish: Callable[[Request, float], None] | None = None,
    ):
        """`controlled`: the batching policy runs outside (a ClusterControl sets `external`).
        `on_finish`: told of every request that ends here, and when."""
        c = self.config = config
        self.clock = VirtualClock(start_s)
        self.runner = CostModelRunner(
            c.model,
            c.gpu,
            self.clock,
            c.cost,
            c.cache,
            c.scheduler.max_model_len,
            spec_acceptance=c.spec_acceptance,
            lora_rank=c.lora.max_lora_rank if c.lora.enabled else 0,
        )
        kv = KVCacheManager(
            self.runner.num_kv_blocks(), c.cache.block_size, c.cache.enable_prefix_caching
        )
        sched_config = c.scheduler
        speculator = Speculator(c.speculative, SimulatedDrafts()) if c.speculative.enabled else None
        slots = LoRASlots(c.lora.max_loras) if c.lora.enabled else None
        self.scheduler = Scheduler(sched_config, kv, self.clock, speculator, slots)
        self._adapters: dict[str, LoRARequest] = {}
        # Static is the scheduler's own fixed limit: no policy call (and no stats) per step.
        policy: BatchingPolicy | None = (
            None
            if c.policy == "static"
            else make_policy(c.policy, c.scheduler.max_num_seqs, c.memory_aware, c.sla)
        )
        self.external: ExternalLimits | None = None
        if controlled:
            policy = self.external = ExternalLimits(sched_config.limits())
        self.core = EngineCore(self.scheduler, self.runner, self.clock, policy)
        self.records = records
        self.on_finish = on_finish
        self.live: dict[str, Request] = {}
        self.asked: dict[str, SimRequest] = {}  # each live request as it was asked
        self.kv_series: list[tuple[float, float]] = []
        self.seqs_series: list[tuple[float, int]] = []
        self.batch_sum = 0
        self.steps = 0
        self.cohort_steps = 0  # of `steps`, those the decode cohort took
        # Steady decoders moved together where the scheduler's decisions allow it.
        self.cohort = (
            DecodeCohort(self.scheduler, self.clock, self.runner.sampled_token_id)
            if c.decode_cohort and DecodeCohort.fits(self.scheduler, policy)
            else None
        )
        self._prompts: dict[int, list[int]] = {}

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_requests(self) -> int:
        """Requests queued or running here (the router's load)."""
        return len(self.live)

    def add(
        self,
        req: SimRequest,
        prefilled_s: float | None = None,
        at_s: float | None = None,
        prompt: list[int] | None = None,
        moved: MovedSequence | None = None,
    ) -> None:
        """Hand a request over at `at_s` (its arrival time unless given; an idle replica's
        clock catches up). `prefilled_s`: it comes with its prompt's KV and its first token,
        made at a prefill replica at that time (disaggregated serving): it decodes here.
        `prompt`: its token ids where the caller made them (cluster/conversations.py).
        `moved`: it comes from another replica (`move_out`), and goes on where it stood."""
        at_s = req.arrival_s if at_s is None else at_s
        if not self.busy and self.clock.now() < at_s:
            self.clock.advance(at_s - self.clock.now())
        if moved is None:
            record = RequestRecord(req.arrival_s, req.prompt_len, req.output_len, prefilled_s)
            self.records[req.request_id] = record
        else:
            prompt = moved.prompt
        if prompt is None and self.config.cache.enable_prefix_caching:
            prompt = prompt_tokens(req)  # what the cache may find is the content's
        elif prompt is None:  # no content: one list per length, shared
            prompt = self._prompts.get(req.prompt_len)
            if prompt is None:
                prompt = self._prompts[req.prompt_len] = [0] * req.prompt_len
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        lora = None
        if req.adapter is not None and self.config.lora.enabled:
            lora = self._adapters.get(req.adapter)
            if lora is None:
                lora = LoRARequest(req.adapter, len(self._adapters) + 1, "")
                self._adapters[req.adapter] = lora
        request = Request(req.request_id, prompt, params, (), req.arrival_s, lora=lora)
        block_size = self.config.cache.block_size
        if prefilled_s is not None:  # the KV as the emulated engine moves it: a count only
            kv = SequenceKV(prompt, block_size, "simulated")
            request.resume_from(Resume([self.runner.sampled_token_id], 0, kv))
        elif moved is not None:
            context = prompt + moved.output_token_ids
            kv = SequenceKV(context[: moved.num_kv_tokens], block_size, "simulated")
            request.resume_from(Resume(moved.output_token_ids, 0, kv if kv.num_tokens else None))
        self.scheduler.add_request(request)
        self.live[req.request_id] = request
        self.asked[req.request_id] = req

    def move_out(self) -> list[MovedSequence]:
        """End every request here to go on at other replicas, each with the KV of the
        tokens it computed (the last one is computed where it goes: its logits give the
        next), as the engine's move_out does; every block is free after."""
        if self.cohort is not None and self.cohort.active:
            self.cohort.leave()
        moved = []
        for rid, request in self.live.items():
            computed = min(request.num_computed_tokens, request.num_tokens - 1)
            running = request.status == RequestStatus.RUNNING
            record = self.records[rid]
            if record.first_token_s is None:  # (None where it has made no token yet)
                record.first_token_s = request.first_token_time
            prompt = request.all_token_ids[: request.num_prompt_tokens]
            outputs = request.all_token_ids[request.num_prompt_tokens :]
            moved.append(
                MovedSequence(self.asked.pop(rid), prompt, outputs, computed if running else 0)
            )
        self.scheduler.finish_requests(list(self.live), RequestStatus.FINISHED_MOVED)
        self.live.clear()
        return moved

    def step(self) -> None:
        result = self.core.step()
        self.steps += 1
        self.batch_sum += result.num_scheduled
        if result.num_scheduled == 0 and self.scheduler.stats().num_running == 0:
            raise RuntimeError("the scheduler made no progress with requests waiting")
        t = self.clock.now()
        for out in result.outputs:
            if out.finish_reason is not None:  # first-token time is on the Request
                self._finished(self.live[out.request_id], t)
        self._sample(t)

    def _finished(self, request: Request, t: float) -> None:
        del self.live[request.request_id]
        del self.asked[request.request_id]
        rec = self.records[request.request_id]
        if rec.first_token_s is None:  # (a prefilled request's came from its prefill replica)
            rec.first_token_s = request.first_token_time
        rec.num_output = request.num_output_tokens
        rec.finish_s = t
        if self.on_finish is not None:
            self.on_finish(request, t)

    def _sample(self, t: float) -> None:
        if self.steps % self.config.kv_sample_every == 1:
            stats = self.scheduler.stats()
            self.kv_series.append((t, stats.kv_usage))
            self.seqs_series.append((t, stats.max_num_seqs))

    def advance(self, until_s: float) -> None:
        """Take the next step, and those after it that start before `until_s` (the next
        event that could change the batch: an arrival, a tick) where the decode cohort
        can take them; equal to stepping (engine/core/sched/decode_cohort.py)."""
        cohort = self.cohort
        if cohort is not None and (cohort.active or cohort.enter()):
            if self.external is not None:
                self.scheduler.set_limits(self.external.current)
            if cohort.run(until_s, self.runner.run_step, self._cohort_step):
                return
        self.step()

    def _cohort_step(self, t: float, num_scheduled: int, finished: list[Request]) -> None:
        self.steps += 1
        self.cohort_steps += 1
        self.batch_sum += num_scheduled
        for request in finished:
            self._finished(request, t)
        self._sample(t)
