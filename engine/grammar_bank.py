"""Structured outputs through xgrammar: each request's grammar, compiled once per spec, a
matcher per request, and the token bitmask of each step's grammar rows.

xgrammar is imported when the first request with a grammar arrives: an engine that serves
none pays nothing, nor does a step in which no scheduled request carries one.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from engine.core.errors import InvalidParam
from engine.core.outputs import ScheduledRequest
from engine.core.sampling_params import StructuredOutput
from engine.sampling.transfers import to_device

# JSON is generated compact (", " and ": " between items, no other whitespace): a model free
# to put whitespace between any two tokens can fill max_tokens with it, and often does.
JSON_OPTIONS = {"any_whitespace": False}


class GrammarBank:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        # Its cache holds each compiled spec: a schema sent again compiles once.
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        self._matchers: dict[str, Any] = {}
        self._json_rows: set[str] = set()
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        # Fills every grammar row of a step at once, on several threads where there are many.
        self._batch = xgr.BatchGrammarMatcher()
        # Compact JSON has no control character anywhere; xgrammar's length-bounded strings
        # would let raw ones in (invalid JSON): JSON rows never get a token holding one.
        self._no_control = xgr.allocate_token_bitmask(1, vocab_size)[0]
        for token, text in enumerate(info.decoded_vocab[:vocab_size]):
            if any(byte < 0x20 for byte in text):
                self._no_control[token // 32] &= ~(1 << (token % 32))

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec`. Raises InvalidParam naming its field when the spec
        is not a valid schema, regex or grammar."""
        compiler = self._compiler
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, **JSON_OPTIONS)
            if spec.kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', strict_mode=False, **JSON_OPTIONS
                )
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choices))
            return compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidParam(
                spec.param, f"{spec.param}: invalid {spec.kind}: {_reason(exc)}"
            ) from exc

    def start(self, request_id: str, spec: StructuredOutput, output_token_ids: list[int]) -> None:
        """A matcher for the request, past the output it already has (a resumed request)."""
        matcher = self._xgr.GrammarMatcher(self.compile(spec))
        for token in output_token_ids:
            if not matcher.accept_token(token):
                raise InvalidParam("resume", "resume: the output so far breaks the grammar")
        if matcher.is_terminated():
            raise InvalidParam("resume", "resume: the output so far already ends the grammar")
        self._matchers[request_id] = matcher
        if spec.kind in ("json", "json_object"):
            self._json_rows.add(request_id)

    def __len__(self) -> int:
        """Requests holding a matcher (each ended one lets go of its own)."""
        return len(self._matchers)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)
            self._json_rows.discard(rid)

    def holds(self, requests: list[ScheduledRequest]) -> bool:
        return bool(self._matchers) and any(r.request_id in self._matchers for r in requests)

    def mask(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> None:
        """Disallowed tokens of every grammar row of `logits` ([len(requests), vocab],
        contiguous) to -inf: one batched fill of their bitmask rows, one application."""
        # A matcher done with its document gets no mask: its request ends when the engine
        # reads the step that finished it, and its row in a step already launched is dropped.
        live = {
            r.request_id
            for r in requests
            if (m := self._matchers.get(r.request_id)) is not None and not m.is_terminated()
        }
        rows = [i for i, r in enumerate(requests) if r.request_id in live]
        if not rows:
            return
        if self._bitmask.shape[0] < len(requests):
            self._bitmask = self._xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        bitmask = self._bitmask[: len(requests)]
        matchers = [self._matchers[requests[i].request_id] for i in rows]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        json_rows = [i for i in rows if requests[i].request_id in self._json_rows]
        if json_rows:
            bitmask[json_rows] &= self._no_control
        # A pinned copy: the buffer is refilled by the next step while this copy may wait.
        self._xgr.apply_token_bitmask_inplace(
            logits, to_device(bitmask, logits.device), indices=rows
        )

    def accept(self, request_ids: list[str], tokens: list[int]) -> None:
        """The tokens a step sampled, once they are on the host (when the engine collects
        the step: the next step's masks need them, the previous step's outputs must not)."""
        for rid, token in zip(request_ids, tokens, strict=True):
            matcher = self._matchers.get(rid)
            if matcher is not None and not matcher.is_terminated():
                matcher.accept_token(token)

    def terminated(self, request_id: str) -> bool:
        """True once the request's grammar has accepted a whole document and its end."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()


def _reason(exc: Exception) -> str:
    """xgrammar's message without its time, source line and assertion prefixes."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return repr(exc)
    return re.sub(r"^\[[\d:.]+\] \S+?:\d+: (Check failed: .*? is false: )?", "", lines[0])


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF of exactly one of the strings (a JSON string literal is a valid EBNF one)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
