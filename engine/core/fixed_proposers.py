"""Proposers whose acceptance is set, not earned (pure Python). Random-weight models say
little about real acceptance; these say what a given acceptance buys: ReplayProposer drafts
each request's known future tokens with a set share corrupted (benchmarks and tests on the
real engine), SimulatedDrafts drafts placeholders the simulator's runner accepts at a set
rate."""

from __future__ import annotations

import zlib

from engine.core.request import Request


class ReplayProposer:
    """Drafts request `rid`'s output tokens from `outputs[rid]` (its output decoded without
    speculation), each draft replaced by another token with probability 1 - `acceptance`,
    decided by a hash of (request, position): the same drafts every run."""

    dry_means_none_soon = False

    def __init__(self, outputs: dict[str, list[int]], acceptance: float, vocab_size: int) -> None:
        self.outputs = outputs
        self.acceptance = acceptance
        self.vocab_size = vocab_size

    def propose(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        return [self.propose_one(request, k) for request, k in wanted]

    def propose_one(self, request: Request, k: int) -> list[int]:
        known = self.outputs.get(request.request_id, [])
        start = request.num_output_tokens
        return [
            self._draft(request.request_id, p, known[p])
            for p in range(start, start + k)
            if p < len(known)
        ]

    def forget(self, request_id: str) -> None:
        pass

    def _draft(self, request_id: str, position: int, token: int) -> int:
        u = zlib.crc32(f"{request_id}:{position}".encode()) / 2**32
        return token if u < self.acceptance else (token + 1) % self.vocab_size


class SimulatedDrafts:
    """The simulator's proposer: k placeholder drafts for every request; the
    CostModelRunner decides how many count (its spec_acceptance)."""

    def __init__(self, token: int = 1) -> None:
        self.token = token

    def propose(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        return [[self.token] * k for _, k in wanted]

    def forget(self, request_id: str) -> None:
        pass
