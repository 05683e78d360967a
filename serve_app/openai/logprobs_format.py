"""OpenAI's `logprobs` objects for one request's sampled tokens (engine TokenLogprob records):
completions' legacy shape (tokens, token_logprobs, top_logprobs, text_offset) and chat's
(`content`: token, logprob, bytes, top_logprobs), streamed chunk by chunk or whole."""

from __future__ import annotations

from typing import Any

from engine.core.outputs import TokenLogprob


class LogprobsFormatter:
    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.text_offset = 0  # completions: where the next token's text starts

    def format(
        self, token_ids: list[int], logprobs: list[TokenLogprob | None] | None
    ) -> dict | None:
        """The object for these tokens (the next ones of the request). A None entry (an echoed
        prompt's first token, which nothing predicts) has null logprobs."""
        if not logprobs:
            return None
        pairs = list(zip(token_ids, logprobs, strict=True))
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in pairs]}
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token, lp in pairs:
            piece = self._piece(token)
            out["tokens"].append(piece)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(piece)
            top = None
            if lp is not None:
                # As vLLM: the sampled token is always there, with up to `logprobs` others.
                top = {self._piece(t): v for t, v in lp.top}
                top.setdefault(piece, lp.logprob)
            out["token_logprobs"].append(lp.logprob if lp is not None else None)
            out["top_logprobs"].append(top)
        return out

    def _chat_entry(self, token: int, lp: TokenLogprob) -> dict[str, Any]:
        piece = self._piece(token)
        return {
            "token": piece,
            "logprob": lp.logprob,
            "bytes": list(piece.encode()),
            "top_logprobs": [
                {"token": p, "logprob": v, "bytes": list(p.encode())}
                for p, v in ((self._piece(t), v) for t, v in lp.top)
            ],
        }

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])
