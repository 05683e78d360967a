"""Log-probabilities of sampled tokens and of prompt tokens, computed on the step's device and
copied to the host behind the step's kernels: a step with rows that ask for them is launched
without waiting for the device, and they are read when the step is collected (after its end).
"""

from __future__ import annotations

import torch

from engine.core.outputs import ScheduledRequest, TokenLogprob
from engine.sampling.transfers import to_device, to_host


class TokenLogprobs:
    """Per row of log-probabilities `raw` [rows, vocab]: the log-probability of `tokens[row]`
    and the `ks[row]` most likely tokens', on their way to the host."""

    def __init__(self, raw: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> None:
        self._ks = ks
        chosen = raw.gather(1, tokens[:, None].to(torch.int64))[:, 0]
        k = max(ks, default=0)
        values, ids = raw.topk(k, dim=-1) if k else (raw[:, :0], chosen[:, None][:, :0])
        self._host = [to_host(t) for t in (chosen, values, ids)]

    def entries(self) -> list[TokenLogprob]:
        """Once the step is done: one entry per row."""
        chosen, values, ids = (t.tolist() for t in self._host)
        out = []
        for row, n in enumerate(self._ks):
            top = zip(ids[row][:n], values[row][:n], strict=True)
            out.append(TokenLogprob(chosen[row], [(int(t), v) for t, v in top]))
        return out


class SampledLogprobs:
    """The log-probabilities of the requests that ask for them, of the raw logits (before
    biases, penalties, temperature and filters), as vLLM reports them."""

    def __init__(self, raw: torch.Tensor, tokens: torch.Tensor, requests: list[ScheduledRequest]):
        self._ids = [r.request_id for r in requests]
        self._rows = TokenLogprobs(raw, tokens, [r.sampling_params.logprobs or 0 for r in requests])

    def by_request(self) -> dict[str, TokenLogprob]:
        return dict(zip(self._ids, self._rows.entries(), strict=True))


class PromptLogprobs:
    """Prompt log-probabilities from `logits` [rows, vocab], the rows of the requests with
    `prompt_targets`, in order."""

    def __init__(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> None:
        self._asking = [r for r in requests if r.prompt_targets]
        targets = to_device([t for r in self._asking for t in r.prompt_targets], logits.device)
        ks = [
            r.sampling_params.prompt_logprobs or 0 for r in self._asking for _ in r.prompt_targets
        ]
        self._rows = TokenLogprobs(logits.float().log_softmax(-1), targets, ks)

    def by_request(self) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """Per request: (prompt position of its first entry, entries)."""
        entries, out, at = self._rows.entries(), {}, 0
        for r in self._asking:
            count = len(r.prompt_targets)
            out[r.request_id] = (r.num_computed_tokens + 1, entries[at : at + count])
            at += count
        return out
