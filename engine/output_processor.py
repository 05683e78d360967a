"""Core outputs to request outputs: each collected step's tokens detokenized, stop strings
applied, logprobs and prompt logprobs attached, per request (pure Python beside the
tokenizer). It reports the requests a stop string ended; the engine tells the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.engine_core import StepResult
from engine.core.outputs import RequestOutput, TokenLogprob
from engine.core.request import Request, RequestStatus
from engine.detokenizer import IncrementalDetokenizer
from engine.grammar_bank import GrammarBank

STOPPED = RequestStatus.FINISHED_STOPPED


@dataclass
class TrackedRequest:
    """What the engine keeps of each request it serves beside the scheduler's record."""

    request: Request
    detokenizer: IncrementalDetokenizer
    # When the request asks: filled by position as its prompt computes (a recomputed chunk
    # writes the same values again), sent on its first delta, then dropped.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tracked: dict[str, TrackedRequest] = {}
        self.grammars: GrammarBank | None = None  # the engine's, once it makes one

    def add(self, request: Request) -> None:
        """Track a request the scheduler now holds (a resumed one with its text so far)."""
        detok = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params.stop
        )
        if request.resumed is not None:  # the text so far, of which the client has some
            detok.update(request.resumed.output_token_ids, finished=False)
            detok.emitted = request.resumed.num_text_chars
        tracked = TrackedRequest(request, detok)
        if request.sampling_params.prompt_logprobs is not None:
            tracked.prompt_logprobs = [None] * request.num_prompt_tokens
        self.tracked[request.request_id] = tracked

    def drop(self, request_id: str) -> TrackedRequest | None:
        """Forget an ended request (its grammar's matcher too)."""
        if self.grammars is not None:
            self.grammars.forget([request_id])
        return self.tracked.pop(request_id, None)

    def process(self, result: StepResult) -> tuple[list[RequestOutput], list[str]]:
        """The deltas of one collected step, and the requests a stop string (or a finished
        grammar) ended that the scheduler still runs."""
        if result.error is not None:
            return [self.error_output(o.request_id, result.error) for o in result.outputs], []
        for rid, (position, entries) in result.prompt_logprobs.items():
            tracked = self.tracked.get(rid)
            if tracked is not None and tracked.prompt_logprobs is not None:
                tracked.prompt_logprobs[position : position + len(entries)] = entries
        outputs = []
        stopped = []
        grammars = self.grammars
        for core in result.outputs:
            tracked = self.tracked.get(core.request_id)
            if tracked is None:
                continue
            new_ids = core.new_token_ids
            text, hit_stop, taken = tracked.detokenizer.update_stepwise(new_ids, core.finished)
            dropped = len(new_ids) - taken  # after a stop string, within one step
            new_ids = new_ids[:taken]
            # The grammar's document is whole: it ends the request (even with ignore_eos).
            hit_stop = hit_stop or (grammars is not None and grammars.terminated(core.request_id))
            finish_reason = core.finish_reason
            if hit_stop:  # a stop string ends the request whatever else happened this step
                if not core.finished:
                    stopped.append(core.request_id)
                finish_reason = STOPPED.finish_reason
            req = tracked.request
            outputs.append(
                RequestOutput(
                    request_id=core.request_id,
                    new_token_ids=new_ids,
                    new_text=text,
                    finished=finish_reason is not None,
                    finish_reason=finish_reason,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_output_tokens=req.num_output_tokens - dropped,
                    queue_time_s=(
                        req.first_scheduled_time - req.arrival_time
                        if finish_reason is not None and req.first_scheduled_time is not None
                        else None
                    ),
                    num_preemptions=req.num_preemptions,
                    logprobs=_logprobs_of(result.logprobs, core.request_id, new_ids),
                    prompt_logprobs=tracked.take_prompt_logprobs(),
                    embedding=core.embedding,
                    num_cached_tokens=req.num_cached_prompt_tokens or 0,
                )
            )
            if finish_reason is not None:
                self.drop(core.request_id)
        return outputs, stopped

    def error_output(self, request_id: str, error: str) -> RequestOutput:
        tracked = self.drop(request_id)
        n_prompt = tracked.request.num_prompt_tokens if tracked else 0
        n_out = tracked.request.num_output_tokens if tracked else 0
        return RequestOutput(request_id, [], "", True, "error", n_prompt, n_out, error=error)


def _logprobs_of(
    logprobs: dict[str, TokenLogprob], request_id: str, new_token_ids: list[int]
) -> list[TokenLogprob] | None:
    entry = logprobs.get(request_id)
    return [entry] if entry is not None and new_token_ids else None
