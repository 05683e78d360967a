"""Incremental detokenization with stop strings; never emits a broken multi-byte character."""

from __future__ import annotations

# Prompt tokens decoded along with the output, so tokenizers that drop a leading space at
# the start of a decode (sentencepiece) still give the right first word.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed output token ids, get text deltas.

    Decodes a short window of tokens each time (not the whole output), and holds text back
    while it ends in U+FFFD: the bytes of a multi-byte character may still be coming. With
    stop strings, the last `max(len(stop)) - 1` characters are held back until the request
    ends, so a stop string split across steps never reaches the client.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.tokens = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the output text so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of `text` already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, new_token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Return (text delta, stop string hit). After a stop hit, the text ends before it."""
        start_len = len(self.text)
        self.tokens.extend(new_token_ids)
        if new_token_ids:
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset :])
            # At the end, flush whatever is left, even an incomplete character.
            if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        stopped = self._find_stop(start_len)
        end = len(self.text) if finished or stopped else len(self.text) - self.holdback
        delta = self.text[self.emitted : max(end, self.emitted)]
        self.emitted += len(delta)
        return delta, stopped

    def update_stepwise(self, new_token_ids: list[int], finished: bool) -> tuple[str, bool, int]:
        """`update`, a token at a time where stop strings apply, stopping at the token that
        completes one (a step may bring several tokens: speculative decoding). Returns the
        text delta, whether a stop string was hit, and how many of the tokens it took."""
        n = len(new_token_ids)
        if n <= 1 or not self.stop:
            return (*self.update(new_token_ids, finished), n)
        text = ""
        for taken, token in enumerate(new_token_ids, start=1):
            delta, stopped = self.update([token], finished and taken == n)
            text += delta
            if stopped:
                return text, True, taken
        return text, False, n

    def _find_stop(self, start_len: int) -> bool:
        if not self.stop:
            return False
        best = -1
        for s in self.stop:
            idx = self.text.find(s, max(0, start_len - len(s) + 1))
            if idx != -1 and (best == -1 or idx < best):
                best = idx
        if best == -1:
            return False
        self.text = self.text[:best]
        return True
