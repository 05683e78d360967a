"""The engine's record of one request as it moves through the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from engine.core.block_hashes import BASE_SALT
from engine.core.lora_slots import LoRARequest
from engine.core.sampling_params import SamplingParams
from engine.core.sequence_kv import SequenceKV


@dataclass(frozen=True)
class Resume:
    """Where a request stopped at another engine replica (which died, or which it left): the
    output tokens it produced there and the characters of their text the client already has.
    A request added with it goes on from there, as if it had run here all along: its
    max_tokens, min_tokens, penalties and random draws count those tokens as its output.
    `kv`: the KV it computed there, when it moved with it (else its context is computed
    again here)."""

    output_token_ids: list[int]
    num_text_chars: int
    kv: SequenceKV | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # KV dropped: recomputed when it runs again
    SWAPPED = "swapped"  # KV copied to the host pool: copied back when it runs again
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_MOVED = "moved"  # left for another engine replica, with its KV

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
    RequestStatus.FINISHED_MOVED,
}


class Request:
    """Token ids and progress of one request.

    NOTE: `num_computed_tokens` counts tokens whose KV is in the cache. It catches up with
    `num_tokens` (prompt + outputs) one step at a time: a prefill chunk, a decode, or a
    recompute after preemption are all the same thing to the scheduler.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float = 0.0,
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora = lora  # the LoRA adapter it runs with (None: the base model)
        self.lora_slot = -1  # the device slot of its adapter while it runs
        # Cached KV blocks are shared only between requests of one adapter (or none).
        self.cache_salt = BASE_SALT if lora is None else ("lora", lora.lora_id)
        self.priority = priority  # scheduling_policy "priority": lower runs first
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Kept as plain attributes (not properties over the list): the scheduler reads them
        # for every request on every step.
        self.num_tokens = self.num_prompt_tokens
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        # Prompt tokens the prefix cache held at its first admission (None: not admitted yet).
        self.num_cached_prompt_tokens: int | None = None
        self.num_drafts_in_flight = 0  # slots held past its tokens for drafts being verified
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.seq = 0  # the scheduler's arrival sequence number (tie-break of every order)
        self.resumed_at_step = -1  # the step in which it last came back after a preemption
        self.first_token_time: float | None = None
        self.resumed: Resume | None = None  # set by resume_from
        # KV computed at another replica, written into its blocks when it is first admitted.
        self.carried_kv: SequenceKV | None = None
        stop_ids = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self.stop_token_ids = frozenset(stop_ids)

    def resume_from(self, resume: Resume) -> None:
        """Take the tokens produced elsewhere as this request's output so far (before it is
        scheduled: they are computed as a prefix, with the prompt)."""
        self.resumed = replace(resume, kv=None)  # the KV is held once, until admitted
        self.all_token_ids += resume.output_token_ids
        self.num_tokens = len(self.all_token_ids)
        self.num_output_tokens = len(resume.output_token_ids)
        self.carried_kv = resume.kv

    def append_outputs(
        self, tokens: list[int], max_model_len: int
    ) -> tuple[list[int], RequestStatus | None]:
        """Append output tokens in order up to the first that ends the request; returns those
        appended and how it ended (None while it goes on)."""
        for taken, token in enumerate(tokens, start=1):
            self.all_token_ids.append(token)
            self.num_tokens += 1
            self.num_output_tokens += 1
            status = self.stop_status(token, max_model_len)
            if status is not None:
                return tokens[:taken], status
        return tokens, None

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """How the request ends with `token` just appended; None while it goes on."""
        params = self.sampling_params
        n_out = self.num_output_tokens
        if n_out >= params.min_tokens and token in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
