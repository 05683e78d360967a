"""Turn the logits of one step into one token per sampled request."""

from __future__ import annotations

import torch

from engine.core.outputs import ScheduledRequest
from engine.cpu.decoder_ops import argmax_last_dim


class Sampler:
    """Greedy rows in one vectorized argmax; random rows one by one with each request's own
    generator, so the same seed gives the same tokens whatever the batch."""

    def __init__(self, seed: int = 0) -> None:
        self._seed_source = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def sample(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> list[int]:
        """logits: [len(requests), vocab] on any device. May modify logits in place. Greedy
        rows are reduced where the logits are (only token ids cross to the host); a random
        row is copied to the host as float32, where each request's generator lives."""
        for i, req in enumerate(requests):
            if req.banned_token_ids:
                logits[i, list(req.banned_token_ids)] = float("-inf")
        tokens = argmax_last_dim(logits).tolist()
        for i, req in enumerate(requests):
            if not req.sampling_params.greedy:
                tokens[i] = self._sample_row(logits[i].to("cpu", torch.float32), req)
        return tokens

    def _sample_row(self, row: torch.Tensor, req: ScheduledRequest) -> int:
        params = req.sampling_params
        row = row / params.temperature
        if 0 < params.top_k < row.shape[-1]:
            kth = torch.topk(row, params.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # Drop a token when the tokens ranked above it already cover top_p.
            drop = probs.cumsum(-1) - probs >= params.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            row = torch.empty_like(row).scatter_(0, order, sorted_logits)
        probs = row.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(req)).item())

    def _generator(self, req: ScheduledRequest) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            seed = req.sampling_params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source).item())
            gen = self._generators[req.request_id] = torch.Generator().manual_seed(seed)
        return gen
