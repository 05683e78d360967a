"""Plain records that cross module boundaries: scheduler -> runner -> scheduler -> engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.lora_slots import LoRALoad
    from engine.core.request import Request
    from engine.core.sequence_kv import SequenceKV


# The input token of a row scheduled before the step that samples it has run: the runner
# takes it from that step's sampled tokens (engine/core/sched/continuation.py).
UNKNOWN_TOKEN = -1


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    num_computed_tokens: int  # position of token_ids[0]
    block_ids: list[int]  # the request's whole block table (read it during this step only)
    # True when the step reaches the request's last token: sample the next one (never for
    # an embedding request: its rows are pooled, engine/runner/pooler.py).
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int
    banned_token_ids: tuple[int, ...] = ()  # masked while min_tokens is not reached
    # Prompt + output tokens so far, for penalties (only when they apply and this step
    # samples; the last num_output_tokens are the output).
    seen_token_ids: list[int] | None = None
    # Prompt log-probabilities (when asked, while positions before the prompt's last are
    # computed): the prompt tokens this step's positions predict, one per position from the
    # first.
    prompt_targets: list[int] | None = None
    # Speculative decoding: the last num_drafts of token_ids are drafts. Every position from
    # the request's last token on is sampled, each with its own counter, and the drafts
    # count while they equal those draws (engine/sampling/verification.py).
    num_drafts: int = 0
    lora_slot: int = -1  # the device slot of its LoRA adapter (-1: the base model)
    # An embedding request's chunk that ends its prompt: the runner returns its vector.
    pooled: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def of(cls, request: Request, n: int, block_ids: list[int]) -> ScheduledRequest:
        """The next `n` tokens of `request` (stop tokens banned while min_tokens is not
        reached, when this step samples)."""
        start = request.num_computed_tokens
        params = request.sampling_params
        reaches_end = start + n == request.num_tokens
        sample = reaches_end and params.pooling is None
        banned: tuple[int, ...] = ()
        if sample and request.num_output_tokens < params.min_tokens:
            banned = tuple(sorted(request.stop_token_ids))
        targets = None
        if params.prompt_logprobs is not None:
            last_prompt = request.num_prompt_tokens - 1
            if start < last_prompt:
                targets = request.all_token_ids[start + 1 : min(start + n, last_prompt) + 1]
        return cls(
            request.request_id,
            request.all_token_ids[start : start + n],
            start,
            block_ids,
            sample,
            params,
            request.num_output_tokens,
            banned,
            request.all_token_ids if sample and params.penalized else None,
            targets,
            lora_slot=request.lora_slot,
            pooled=reaches_end and not sample,
        )

    @classmethod
    def speculative(
        cls, request: Request, drafts: list[int], block_ids: list[int]
    ) -> ScheduledRequest:
        """A decoding request's last token followed by its drafts."""
        row = cls.of(request, 1, block_ids)
        row.token_ids = row.token_ids + drafts
        row.num_drafts = len(drafts)
        return row


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    num_draft_tokens: int = 0  # of num_batched_tokens: speculative drafts to verify
    # Requests that ended or were preempted since the last step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Swap preemption, as (source block, destination block) pairs. The runner copies every
    # swap-out (device -> host) first, then every swap-in (host -> device), then runs the step.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Adapters the runner loads into their slots before the step (engine/core/lora_slots.py).
    lora_loads: list[LoRALoad] = field(default_factory=list)
    # KV computed at another replica, written into these blocks before the step runs.
    kv_imports: list[tuple[SequenceKV, list[int]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be swaps to carry out)."""
        return not self.scheduled

    @property
    def has_swaps(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in)


@dataclass(slots=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (raw logits, before temperature,
    penalties and filters) and the `logprobs` most likely tokens' (id, log-probability)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # requests that ask
    # Requests that ask for prompt logprobs: (prompt position of the first, one per position).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # Rows with drafts: the accepted drafts, then the target's own next token (1 to k+1
    # tokens; sampled_token_ids does not hold these requests).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Embedding requests whose prompt this step finished: the pooled vector.
    pooled: dict[str, list[float]] = field(default_factory=dict)


class PendingStep(Protocol):
    """A step the runner has taken on. `ready`: its result is on the host already (the CPU
    computes a step when it is launched; a GPU runs it while the host goes on). `result()`
    waits for it and is called once."""

    ready: bool

    def result(self) -> ModelRunnerOutput: ...


@dataclass
class ReadyStep:
    """A step computed when it was launched (or a runner without `launch`)."""

    output: ModelRunnerOutput
    ready: bool = True

    def result(self) -> ModelRunnerOutput:
        return self.output


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request, before detokenization."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    embedding: list[float] | None = None  # an embedding request's, when it ends

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A delta for one request: the tokens and text it produced in one step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    # On the finished delta: seconds from arrival to first scheduled (None if never run).
    queue_time_s: float | None = None
    num_preemptions: int = 0  # on the finished delta
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asks
    # On the first delta, when the request asks: one per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's, on its finished delta
    # Prompt tokens read from the prefix cache rather than computed (set on every delta).
    num_cached_tokens: int = 0

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by a later one of the same request, as one delta."""
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            finished=later.finished,
            finish_reason=later.finish_reason,
            num_prompt_tokens=later.num_prompt_tokens,
            num_output_tokens=later.num_output_tokens,
            error=later.error,
            queue_time_s=later.queue_time_s,
            num_preemptions=later.num_preemptions,
            logprobs=(
                (self.logprobs or []) + (later.logprobs or [])
                if self.logprobs is not None or later.logprobs is not None
                else None
            ),
            prompt_logprobs=self.prompt_logprobs,
            embedding=later.embedding,
            num_cached_tokens=later.num_cached_tokens,
        )


@dataclass
class GenerationResult:
    """A finished request, whole: what `LLMEngine.generate` returns."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_used_blocks: int
    num_total_blocks: int
    kv_usage: float
    max_num_seqs: int
    max_num_batched_tokens: int
    num_preemptions_total: int
    num_steps_total: int
    # Ended requests by finish reason ("stop", "length", "abort", "error").
    num_finished_total: dict[str, int] = field(default_factory=dict)
    num_decoding: int = 0  # requests that decoded (one token, past prefill) in the last step
    # The last step, for latency-driven policies: its batch, whether it was decode-only (no
    # prefill chunk), and its duration as the engine's clock measured it.
    last_step_num_seqs: int = 0
    last_step_decode_only: bool = False
    last_step_duration_s: float | None = None
    # Running totals over decode-only steps (see engine.core.sched.step_stats.StepStats).
    decode_steps_total: int = 0
    decode_step_seconds_total: float = 0.0
    decode_step_seqs_total: int = 0
    # Prefix caching: prompt tokens looked up at admission, and how many were in the cache.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_swapped: int = 0  # requests whose KV waits in the host pool
    num_swap_outs_total: int = 0
    num_free_host_blocks: int = 0
    spec: SpecDecodeStats | None = None  # with speculative decoding on
    # LoRA adapters (with LoRA on): slots, and the adapters of running and waiting requests.
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


@dataclass
class SpecDecodeStats:
    """Speculative decoding's running totals, under vLLM's metric names: verified draft
    groups, drafted and accepted tokens, and accepted tokens by position (0: a first
    draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_steps_off: int = 0  # steps in which the adaptive rule drafted nothing

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


class _DeltaQueue(Protocol):
    def empty(self) -> bool: ...
    def get_nowait(self) -> RequestOutput | BaseException: ...


def merge_queued(
    item: RequestOutput | BaseException, queue: _DeltaQueue
) -> RequestOutput | BaseException:
    """`item` merged with every delta of the same request already waiting in `queue`: a slow
    consumer gets everything produced since its last read as one delta. Stops at a finished
    delta or an exception (which replaces what was merged)."""
    while not queue.empty() and isinstance(item, RequestOutput) and not item.finished:
        later = queue.get_nowait()
        item = item.merge(later) if isinstance(later, RequestOutput) else later
    return item
