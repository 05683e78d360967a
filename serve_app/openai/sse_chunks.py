"""The SSE events of one streamed response, encoded as the ingress sends them at a GPU's token
rate: the fields every chunk of the response shares (id, object, created, model, usage) are
encoded once, and each chunk splices in only its choice; a plain text delta, the chunk nearly
every engine step makes, is written from a template without building its dict."""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _string  # type: ignore[attr-defined]
from typing import Any

_compact = json.JSONEncoder(separators=(",", ":")).encode
_FINISH = {None: "null"}  # finish reasons encoded, filled as they come


def sse(data: Any) -> str:
    return f"data: {_compact(data)}\n\n"


def _finish(reason: str | None) -> str:
    encoded = _FINISH.get(reason)
    if encoded is None:
        encoded = _FINISH[reason] = _string(reason)
    return encoded


class ChunkEncoder:
    """`base`: the fields each chunk of the response shares, in order (its `choices` come
    after them)."""

    def __init__(self, base: dict[str, Any]) -> None:
        self._head = f'data: {_compact(base)[:-1]},"choices":['

    def event(self, choice: dict[str, Any]) -> str:
        """A chunk of one choice."""
        return f"{self._head}{_compact(choice)}]}}\n\n"

    def text(self, index: int, text: str, finish_reason: str | None) -> str:
        """A completions chunk of plain text (no logprobs): completion_choice's fields."""
        return (
            f'{self._head}{{"index":{index},"text":{_string(text)},"logprobs":null,'
            f'"finish_reason":{_finish(finish_reason)}}}]}}\n\n'
        )

    def content(self, index: int, content: str) -> str:
        """A chat chunk whose delta is only content (no logprobs, not finished):
        chat_delta_choice's fields."""
        return (
            f'{self._head}{{"index":{index},"delta":{{"content":{_string(content)}}},'
            f'"logprobs":null,"finish_reason":null}}]}}\n\n'
        )
