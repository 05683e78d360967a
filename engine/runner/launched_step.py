"""A step on its way through the device: its sampled token ids come to the host when the
engine collects it, and the device time it took is counted then.

On a GPU the step's kernels and a non-blocking copy of its token ids into pinned host memory
are queued, and the host goes on (the engine detokenizes the previous step meanwhile); on
the CPU the step is done by the time it is launched.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.core.outputs import ModelRunnerOutput
from engine.sampling.logprobs import PromptLogprobs, SampledLogprobs
from engine.sampling.transfers import to_host
from engine.sampling.verification import accepted_tokens

if TYPE_CHECKING:
    from engine.grammar_bank import GrammarBank


class DeviceClock:
    """Seconds the device spent on steps: CUDA events around each step, read once the step
    is done (no synchronisation of its own); on the CPU, the host's clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0

    def start(self) -> torch.cuda.Event | float:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: torch.cuda.Event | float) -> torch.cuda.Event | None:
        """The step's end: counted now on the CPU; on CUDA an event to wait on."""
        if not self.cuda:
            self.seconds += time.perf_counter() - started
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return end

    def settle(self, started: torch.cuda.Event | float, end: torch.cuda.Event | None) -> None:
        """Wait for the step's end and count it (CUDA)."""
        if end is not None:
            end.synchronize()
            self.seconds += started.elapsed_time(end) / 1e3


class LaunchedStep:
    """A step's sampled tokens (`tokens`, on the step's device, one per `request_ids`) and
    log-probabilities, all copied to the host behind its kernels. When collected, the tokens
    go to the grammar matchers of the step's structured rows (`grammars`, where it has any),
    and the rows with drafts (`drafts`, whose ids repeat in `request_ids`, once per position)
    keep what verification accepts."""

    def __init__(
        self,
        request_ids: list[str],
        tokens: torch.Tensor,
        clock: DeviceClock,
        started: torch.cuda.Event | float,
        grammars: GrammarBank | None = None,
        logprobs: SampledLogprobs | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
        drafts: dict[str, list[int]] | None = None,
        decided: dict[str, list[int]] | None = None,
        pooled: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.request_ids = request_ids
        self._host = to_host(tokens)
        self._clock, self._started = clock, started
        self._end = clock.stop(started)
        self.ready = self._end is None
        self._grammars = grammars
        self._logprobs, self._prompt_logprobs = logprobs, prompt_logprobs
        self._drafts = drafts or {}
        self._decided = decided or {}  # rows verified by rejection sampling: their tokens
        self._pooled = pooled or {}  # embedding requests' vectors

    def result(self) -> ModelRunnerOutput:
        self._clock.settle(self._started, self._end)
        ids = self._host.tolist()
        if self._grammars is not None:
            self._grammars.accept(self.request_ids, ids)
        logprobs, prompt = self._logprobs, self._prompt_logprobs
        sampled = dict(zip(self.request_ids, ids, strict=True))
        spec: dict[str, list[int]] = {}
        if self._drafts:
            for rid, token in zip(self.request_ids, ids, strict=True):
                if rid in self._drafts:
                    spec.setdefault(rid, []).append(token)
                    sampled.pop(rid, None)
            decided = self._decided
            spec = {
                rid: decided[rid] if rid in decided else accepted_tokens(self._drafts[rid], draws)
                for rid, draws in spec.items()
            }
        return ModelRunnerOutput(
            sampled,
            logprobs.by_request() if logprobs is not None else {},
            prompt.by_request() if prompt is not None else {},
            spec,
            {rid: vector.tolist() for rid, vector in self._pooled.items()},
        )
