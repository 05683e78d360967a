"""The engine: launch steps, collect them, detokenize, apply stop strings."""

from __future__ import annotations

import logging
import threading
from array import array
from dataclasses import replace

from engine.core.clock import Clock, MonotonicClock
from engine.core.config import EngineConfig
from engine.core.engine_core import EngineCore, StepResult
from engine.core.errors import InvalidParam
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.lora_slots import LoRASlots
from engine.core.outputs import GenerationResult, RequestOutput, SchedulerStats
from engine.core.policy import BatchingPolicy
from engine.core.request import Request, RequestStatus, Resume
from engine.core.sampling_params import SamplingParams, check_in_vocabulary
from engine.core.sched.inspection import check_request
from engine.core.sched.scheduler import Scheduler
from engine.core.sequence_kv import SequenceKV
from engine.grammar_bank import GrammarBank
from engine.lora.registry import LoRARegistry
from engine.model.stop_tokens import eos_token_ids
from engine.output_processor import OutputProcessor
from engine.runner.base import ModelRunner
from engine.runner.draft_proposer import speculator_for

logger = logging.getLogger(__name__)


class LLMEngine:
    """Serves many requests at once, one forward step at a time.

    `add_request` queues (ValueError names a bad field), `step` runs one iteration and returns
    per-request deltas, `abort` ends a request and frees its blocks. Not thread-safe: call it
    from one thread (AsyncLLMEngine does that for asyncio code).
    """

    def __init__(
        self,
        config: EngineConfig,
        policy: BatchingPolicy | None = None,
        runner: ModelRunner | None = None,
        tokenizer=None,
        clock: Clock | None = None,
    ) -> None:
        from engine.model.loader import check_model_dir, read_spec
        from engine.model.model_source import local_checkpoint

        local = local_checkpoint(
            config.model, "model", config.revision, config.object_store_endpoint_url
        )
        config = replace(config, model=local)
        check_model_dir(config.model)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.config = config
        self.tokenizer = tokenizer
        if runner is None and config.device == "emulated":
            from engine.runner.emulated_runner import EmulatedRunner

            runner = EmulatedRunner(config, tokenizer)
        elif runner is None:
            from engine.runner.torch_runner import TorchModelRunner

            runner = TorchModelRunner(config)
        self.runner = runner
        self.eos_token_ids = eos_token_ids(config.model, tokenizer)
        sched_config = replace(config.scheduler, max_model_len=runner.max_model_len())
        swap = config.scheduler.preemption_mode == "swap"
        kv = KVCacheManager(
            runner.num_kv_blocks(),
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            num_host_blocks=runner.num_host_blocks() if swap else 0,
        )
        self.clock = clock or MonotonicClock()
        speculator = speculator_for(config, runner, tokenizer)
        slot_weights = getattr(runner, "lora", None)  # the registry's reads fill its host cache
        keep = slot_weights.keep if slot_weights is not None else None
        self.loras = LoRARegistry(config.lora, read_spec(config.model), keep)  # served, by name
        slots = LoRASlots(config.lora.max_loras) if config.lora.enabled else None
        self.scheduler = Scheduler(sched_config, kv, self.clock, speculator, slots)
        self.core = EngineCore(self.scheduler, runner, self.clock, policy)
        self.outputs = OutputProcessor(tokenizer)
        self._grammars: GrammarBank | None = None  # made for the first structured request
        self._grammars_made = threading.Lock()
        # Steps whose forward raised, since the last that ran: a replica's health reads it.
        self.num_failed_steps_in_a_row = 0
        self._num_generate_calls = 0  # generate() batches, for request ids
        # Resumed requests that came with their KV: taken (and its tokens), or refused (their
        # context computed again here).
        self.num_kv_carried = self.num_kv_tokens_carried = self.num_kv_refused = 0

    @property
    def policy(self) -> BatchingPolicy | None:
        return self.core.policy

    @policy.setter
    def policy(self, policy: BatchingPolicy | None) -> None:
        self.core.policy = policy

    # ------------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not all(isinstance(t, int) for t in prompt):
            raise InvalidParam("prompt", "prompt: token ids must be integers")
        check_in_vocabulary("prompt", prompt, self.runner_vocab_size())
        return list(prompt)

    def runner_vocab_size(self) -> int:
        spec = getattr(self.runner, "spec", None)
        return spec.vocab_size if spec is not None else len(self.tokenizer)

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        resume: Resume | None = None,
        lora: str | tuple[str, str] | None = None,
    ) -> Request:
        """Validate and tokenize without touching engine state (safe from any thread);
        `lora` names the LoRA adapter to run with, or gives (name, directory)."""
        params = params or SamplingParams()
        params.validate()
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidParam("prompt", "prompt: must not be empty")
        vocab = self.runner_vocab_size()
        check_in_vocabulary("stop_token_ids", params.stop_token_ids, vocab)
        check_in_vocabulary("logit_bias", params.logit_bias, vocab)
        if params.structured is not None:  # compiled here, off the step loop (and cached)
            self.grammar_bank(params.structured.param).compile(params.structured)
        adapter = None
        if lora is not None:
            adapter = self.loras.resolve(*((lora,) if isinstance(lora, str) else lora))
        request = Request(
            request_id, token_ids, params, self.eos_token_ids, priority=priority, lora=adapter
        )
        check_request(self.scheduler, request)
        if resume is not None:
            done = resume.output_token_ids
            ended = request.stop_token_ids.intersection(done[-1:])  # its last token ends it
            if len(done) >= params.max_tokens or ended or any(not 0 <= t < vocab for t in done):
                raise InvalidParam("resume", "resume: not the output of an unfinished request")
            request.resume_from(resume)
        return request

    def _kv_refusal(self, request: Request) -> str | None:
        """Why the KV a resumed request carries cannot stand for its context here, or None."""
        kv = request.carried_kv
        assert kv is not None
        if not kv.fits(request.all_token_ids, self.config.cache.block_size):
            return "it is not the KV of this request's tokens"
        refusal = getattr(self.runner, "kv_refusal", None)
        return "this engine cannot take KV" if refusal is None else refusal(kv)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> None:
        self.add_prepared(self.make_request(request_id, prompt, params, priority, lora=lora))

    def grammar_bank(self, param: str = "response_format") -> GrammarBank:
        """The engine's structured-output grammars; the runner masks its rows' logits."""
        with self._grammars_made:  # requests may compile in threads of their own
            if self._grammars is None:
                use = getattr(self.runner, "use_grammars", None)
                if use is None:
                    raise InvalidParam(param, f"{param}: this engine cannot constrain its output")
                vocab = self.runner_vocab_size()
                self._grammars = GrammarBank(self.tokenizer, vocab, self.eos_token_ids)
                self.outputs.grammars = self._grammars
                use(self._grammars)
        return self._grammars

    def add_prepared(self, request: Request) -> None:
        if request.carried_kv is not None and (why := self._kv_refusal(request)):
            logger.warning("%s: its KV is computed again here: %s", request.request_id, why)
            request.carried_kv = None
            self.num_kv_refused += 1
        structured = request.sampling_params.structured
        if structured is not None:
            done = request.resumed.output_token_ids if request.resumed else []
            self.grammar_bank().start(request.request_id, structured, done)
        self.scheduler.add_request(request)
        self.outputs.add(request)
        if request.carried_kv is not None:
            self.num_kv_carried += 1
            self.num_kv_tokens_carried += request.carried_kv.num_tokens

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.abort_requests(ids)
        for rid in ids:
            self.outputs.drop(rid)

    def settle(self) -> list[RequestOutput]:
        """Collect the steps in flight without launching another; their deltas."""
        results = []
        while self.core.in_flight:
            results.append(self.core.collect())
        return [delta for result in results for delta in self._deltas(result)]

    def move_out(self, request_ids: list[str]) -> dict[str, SequenceKV | None]:
        """End requests here so that they go on at another replica (`Resume` with `kv`);
        returns each one's KV: its computed tokens' blocks (in the device cache, or the host
        pool where it was swapped out) as plain data, or None where there is nothing to
        export (not computed yet, a runner that cannot).
        Call it with no step in flight (`settle`)."""
        assert not self.core.in_flight, "settle the steps in flight first"
        export = getattr(self.runner, "export_kv", None)
        kv_cache = self.scheduler.kv_cache
        moved: dict[str, SequenceKV | None] = {}
        for rid in request_ids:
            request = self.scheduler.requests.get(rid)
            if request is None:
                continue
            # The last token is computed where it goes on: its logits give the next one.
            n = min(request.num_computed_tokens, request.num_tokens - 1)
            kv = None
            swapped = request.status == RequestStatus.SWAPPED
            running = request.status == RequestStatus.RUNNING
            if export is not None and n > 0 and (swapped or running):
                table = kv_cache.host_block_ids(rid) if swapped else kv_cache.block_ids(rid)
                blocks = table[: kv_cache.blocks_needed(n)]
                kv = export(blocks, request.all_token_ids[:n], swapped)
            moved[rid] = kv
        self.scheduler.finish_requests(list(moved), RequestStatus.FINISHED_MOVED)
        for rid in moved:
            self.outputs.drop(rid)
        return moved

    def cached_blocks(self, limit: int) -> bytes:
        """The keys of the prompt blocks the prefix cache holds (engine/core/block_hashes.py),
        the most recent `limit`, as signed 64-bit ints: what a router reads to send a prompt
        where its prefix is cached."""
        return array("q", self.scheduler.kv_cache.pool.recent_hashes(limit)).tobytes()

    def abort_all(self) -> list[str]:
        """Abort every request held; returns their ids."""
        ids = list(self.scheduler.requests)
        self.abort(ids)
        return ids

    def close(self) -> None:
        """Release what the runner holds beyond this process (tensor-parallel ranks)."""
        getattr(self.runner, "close", lambda: None)()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.core.in_flight)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ------------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """One step on; the deltas of the steps collected. With `overlap_steps` on a device
        that runs steps asynchronously, a step stays in flight while the one before is
        detokenized, and the next is launched before it is collected where the scheduler can
        tell it already (docs/architecture.md, "Overlapped steps")."""
        core, overlap = self.core, self.config.overlap_steps
        results = []
        if core.in_flight:
            if overlap:
                core.launch_continuation()
            results.append(core.collect())
        if not core.in_flight:
            idle_or_failed = core.launch()
            if idle_or_failed is not None:
                results.append(idle_or_failed)
            elif not (overlap and core.in_flight[0].may_overlap):
                results.append(core.collect())
        return [delta for result in results for delta in self._deltas(result)]

    def _deltas(self, result: StepResult) -> list[RequestOutput]:
        """The deltas of one collected step; requests a stop string ended end here."""
        if result.error is not None:
            self.num_failed_steps_in_a_row += 1
        elif result.num_scheduled:
            self.num_failed_steps_in_a_row = 0
        outputs, stopped = self.outputs.process(result)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    # ------------------------------------------------------------------------- offline
    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        loras: list[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion (each with its LoRA adapter where `loras` names one);
        results in prompt order (one SamplingParams for all, or one each)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidParam("params", "params: need one SamplingParams per prompt")
        loras = loras or [None] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidParam("loras", "loras: need one adapter name (or None) per prompt")
        self._num_generate_calls += 1
        ids = [f"generate-{self._num_generate_calls}-{i}" for i in range(len(prompts))]
        results: dict[str, GenerationResult] = {}
        for rid, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
            request = self.make_request(rid, prompt, p, lora=lora)
            self.add_prepared(request)
            results[rid] = GenerationResult(rid, request.prompt_token_ids, [], "", None)
        while self.has_unfinished_requests():
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.token_ids.extend(out.new_token_ids)
                result.text += out.new_text
                if out.finished:
                    result.finish_reason = out.finish_reason
        return [results[rid] for rid in ids]
