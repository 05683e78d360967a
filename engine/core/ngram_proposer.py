"""Draft tokens by prompt lookup (pure Python): the tokens that followed the latest earlier
occurrence of a request's last n tokens, prompt and output alike."""

from __future__ import annotations

from typing import Protocol

from engine.core.request import Request


class Proposer(Protocol):
    """Drafts the next tokens of requests. `propose` gets (request, k) pairs and returns, in
    their order, at most k token ids each (none where it has nothing to offer); it may keep
    state per request, dropped by `forget`. `dry_means_none_soon`: an answer with no draft for
    any request says that their text offers none now, and one more token rarely changes that
    (prompt lookup); not so where it may mean "not yet" (a draft model catching up)."""

    dry_means_none_soon: bool

    def propose(self, wanted: list[tuple[Request, int]]) -> list[list[int]]: ...

    def forget(self, request_id: str) -> None: ...


class NgramProposer:
    """Prompt lookup, as vLLM's ngram method: for n from `max_n` down to `min_n`, the latest
    earlier position where the request's last n tokens occur, and the up to k tokens after it.

    Each request's n-grams are indexed as its tokens arrive (each n-gram maps to the position
    after its latest occurrence), so a proposal costs a few dictionary lookups, not a scan.
    """

    dry_means_none_soon = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first
        self._index: dict[str, tuple[list[dict[tuple[int, ...], int]], list[int]]] = {}

    def propose(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        return [self.propose_one(request, k) for request, k in wanted]

    def propose_one(self, request: Request, k: int) -> list[int]:
        tokens = request.all_token_ids
        tables, indexed = self._index.setdefault(
            request.request_id, ([{} for _ in self.sizes], [0])
        )
        end = len(tokens)
        # Every n-gram whose next token is known, up to the one before the request's suffix.
        for i in range(max(indexed[0], 1), end):
            for table, n in zip(tables, self.sizes, strict=True):
                if i >= n:
                    table[tuple(tokens[i - n : i])] = i
        indexed[0] = end
        for table, n in zip(tables, self.sizes, strict=True):
            if end <= n:
                continue
            after = table.get(tuple(tokens[end - n :]))
            # NOTE: the suffix itself is not indexed yet (its next token is unknown), so a hit
            # is an earlier occurrence; indexing it next call keeps the latest one.
            if after is not None:
                return tokens[after : after + k]
        return []

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
