"""Turn the logits of one step into one token per sampled request, on the logits' device.

Greedy rows reduce with one argmax. Random rows are sampled batched, each by inverse CDF
with one counter-based uniform (engine/sampling/draws.py): a request's n-th token depends
only on its logits, its parameters and (seed, n), never on the rest of the batch: among the
tokens its filters keep, in vocabulary order (engine/sampling/token_draw.py; on CUDA one
kernel for all the random rows, without a sort). Only the token ids cross to the host.

Penalties and logit biases adjust the rows that ask for them first, batched (one index_put
per kind over the step's token lists); a step in which no request uses them pays nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.outputs import UNKNOWN_TOKEN, ScheduledRequest, TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.cpu.decoder_ops import argmax_last_dim
from engine.sampling import token_draw
from engine.sampling.draws import uniforms
from engine.sampling.logprobs import SampledLogprobs
from engine.sampling.transfers import to_device

if TYPE_CHECKING:
    from engine.grammar_bank import GrammarBank

_INT64 = 1 << 64


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seed_source = torch.Generator().manual_seed(seed)
        self._seeds: dict[str, int] = {}  # unseeded requests: a seed drawn at first sight
        # Structured outputs' grammars, set by the engine once a request carries one.
        self.grammars: GrammarBank | None = None
        # Draws the tokens of sampled rows (the GPU self-check may set the sorted draw).
        self.draw_rows = token_draw.draw

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._seeds.pop(rid, None)
        if self.grammars is not None:
            self.grammars.forget(request_ids)

    def sample(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> list[int]:
        """logits: [len(requests), vocab] on any device. May modify logits in place."""
        return self.sample_with_logprobs(logits, requests)[0]

    def sample_with_logprobs(
        self, logits: torch.Tensor, requests: list[ScheduledRequest]
    ) -> tuple[list[int], dict[str, TokenLogprob]]:
        """`sample`, and the log-probabilities of the requests that ask for them: of the raw
        logits (before biases, penalties, temperature and filters), as vLLM reports them."""
        tokens, logprobs = self.draw(logits, requests)
        ids = tokens.tolist()
        if self.grammars is not None:
            self.grammars.accept([r.request_id for r in requests], ids)
        return ids, logprobs.by_request() if logprobs is not None else {}

    def draw(
        self,
        logits: torch.Tensor,
        requests: list[ScheduledRequest],
        previous: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """The sampled token ids as a tensor on the logits' device, and the log-probabilities
        of the requests that ask, on their way to the host; never waits for the device.
        Grammar rows are masked by their matchers' state; the tokens go to the matchers
        (GrammarBank.accept) once they are on the host. `previous`: per row, on the device,
        the token sampled by the step before where the host does not know it yet
        (UNKNOWN_TOKEN ends the row's `seen_token_ids`)."""
        device = logits.device
        asking = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if asking:
            at = to_device(asking, device)
            raw = logits[at].float().log_softmax(-1)  # a copy: taken before the adjustments
        adjust_logits(logits, requests, previous)
        _ban(logits, requests)
        grammars = self.grammars
        if grammars is not None and grammars.holds(requests):
            logits = logits.contiguous()
            grammars.mask(logits, requests)
        tokens = argmax_last_dim(logits)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if random_rows:
            rows = to_device(random_rows, device)
            drawn = self.sample_random(logits[rows], [requests[i] for i in random_rows])
            tokens = tokens.index_copy(0, rows, drawn.to(tokens.dtype))
        if not asking:
            return tokens, None
        return tokens, SampledLogprobs(raw, tokens[at], [requests[i] for i in asking])

    def sample_random(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> torch.Tensor:
        """Token ids [len(requests)] for rows that sample (temperature > 0)."""
        params = [r.sampling_params for r in requests]
        return self.draw_rows(logits, params, self.row_uniforms(requests, logits.device))

    def probabilities(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> torch.Tensor:
        """float32 [rows, vocab]: the distribution each random row's draw samples (biases,
        penalties and bans applied, then temperature and filters), rows summing to 1. May
        modify logits in place."""
        adjust_logits(logits, requests)
        _ban(logits, requests)
        probs = token_draw.kept_probs(logits, [r.sampling_params for r in requests])
        return probs / probs.sum(-1, keepdim=True)

    def row_uniforms(
        self, requests: list[ScheduledRequest], device: torch.device, salt: int = 0
    ) -> torch.Tensor:
        """Each row's counter-based uniform (its request's seed, its output index); `salt`
        picks another stream of the same seed."""
        seeds = to_device([self._seed(r) ^ salt for r in requests], device)
        counters = to_device([r.num_output_tokens for r in requests], device)
        return uniforms(seeds, counters)

    def warm_up(self, vocab: int, device: torch.device) -> None:
        """One filtered draw on zero logits: the device's kernels (on CUDA, the draw's Triton
        compile) are ready before the first request needs them."""
        params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5, min_p=0.1, seed=0)
        row = ScheduledRequest("warm-up", [0], 0, [], True, params, 0)
        self.sample_random(torch.zeros(1, vocab, device=device), [row])

    def _seed(self, req: ScheduledRequest) -> int:
        seed = req.sampling_params.seed
        if seed is None:
            seed = self._seeds.get(req.request_id)
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source).item())
                self._seeds[req.request_id] = seed
        seed %= _INT64  # any Python int, as the int64 with the same low 64 bits
        return seed - _INT64 if seed >= _INT64 // 2 else seed


def _ban(logits: torch.Tensor, requests: list[ScheduledRequest]) -> None:
    """Mask each row's banned tokens (stop tokens below min_tokens)."""
    banned = [(i, t) for i, r in enumerate(requests) for t in r.banned_token_ids]
    if banned:
        rows, ids = zip(*banned, strict=True)
        device = logits.device
        logits[to_device(rows, device), to_device(ids, device)] = float("-inf")


def adjust_logits(
    logits: torch.Tensor, requests: list[ScheduledRequest], previous: torch.Tensor | None = None
) -> None:
    """Apply logit biases, then presence/frequency/repetition penalties, in place, to the rows
    whose requests set them (`previous`: as in Sampler.draw)."""
    rows = [
        i
        for i, r in enumerate(requests)
        if r.sampling_params.logit_bias or r.seen_token_ids is not None
    ]
    if not rows:
        return
    device = logits.device
    sub = logits[to_device(rows, device)].float()
    bias = [
        (j, t, b)
        for j, i in enumerate(rows)
        for t, b in requests[i].sampling_params.logit_bias.items()
    ]
    if bias:
        where_, ids, values = zip(*bias, strict=True)
        index = (to_device(where_, device), to_device(ids, device))
        sub.index_put_(index, to_device(values, device), accumulate=True)
    penalized = [(j, i, requests[i]) for j, i in enumerate(rows) if requests[i].seen_token_ids]
    if penalized:
        _penalize(sub, penalized, previous)
    logits[to_device(rows, device)] = sub.to(logits.dtype)


def _penalize(
    sub: torch.Tensor,
    penalized: list[tuple[int, int, ScheduledRequest]],
    previous: torch.Tensor | None,
) -> None:
    """Presence, frequency and repetition penalties on rows `j` of `sub`, from one count and
    one mask built by index_put over the requests' token lists (a list's UNKNOWN_TOKEN is
    the request's row `i` of `previous`)."""
    device = sub.device
    which = to_device([j for j, _, _ in penalized], device)
    rows = sub[which]
    out_at, out_ids, seen_at, seen_ids = [], [], [], []
    for k, (_, _, r) in enumerate(penalized):
        seen = r.seen_token_ids or []
        output = seen[len(seen) - r.num_output_tokens :] if r.num_output_tokens else []
        out_at += [k] * len(output)
        out_ids += output
        seen_at += [k] * len(seen)
        seen_ids += seen
    unknown = any(r.seen_token_ids[-1] == UNKNOWN_TOKEN for _, _, r in penalized)
    if unknown:
        assert previous is not None, "a row's last token is on the device only"
        last = previous[to_device([i for _, i, _ in penalized], device)]

    def token_ids(at: torch.Tensor, ids: list[int]) -> torch.Tensor:
        ids_ = to_device(ids, device)
        return torch.where(ids_ == UNKNOWN_TOKEN, last[at], ids_) if unknown else ids_

    counts = torch.zeros_like(rows)
    if out_ids:
        at = to_device(out_at, device)
        index = (at, token_ids(at, out_ids))
        counts.index_put_(index, torch.ones(len(out_ids), device=device), accumulate=True)
    seen_mask = torch.zeros_like(rows, dtype=torch.bool)
    at = to_device(seen_at, device)
    seen_mask[at, token_ids(at, seen_ids)] = True

    def column(name: str) -> torch.Tensor:
        values = [getattr(r.sampling_params, name) for _, _, r in penalized]
        return to_device(values, device)[:, None]

    rep = column("repetition_penalty")
    rows = torch.where(seen_mask, torch.where(rows > 0, rows / rep, rows * rep), rows)
    rows -= column("frequency_penalty") * counts + column("presence_penalty") * (counts > 0)
    sub[which] = rows
