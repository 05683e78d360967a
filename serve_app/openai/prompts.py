"""Prompts to token ids at the ingress: the tokenizer and the model's chat template."""

from __future__ import annotations

import json
from typing import Any

from engine.core.errors import InvalidParam


class PromptBuilder:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = len(self.tokenizer)

    def completion(self, prompt: str | list[int]) -> list[int]:
        """A completion's prompt: text, or token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParam(
                "prompt", f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        return list(prompt)

    def chat(self, messages: list[Any], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template applied to the messages (text content, an assistant's tool calls,
        tool results) and the tools, with the generation prompt."""
        turns = [_turn(m) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                turns, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises on role orders a template does not allow
            raise InvalidParam(
                "messages", f"messages: the chat template rejected them: {exc}"
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)


def _turn(message: Any) -> dict[str, Any]:
    """A message as chat templates read it: tool call arguments as objects (templates render
    them as JSON), not the JSON text OpenAI's API carries."""
    turn: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidParam("messages", "messages: a tool call needs a function name")
            arguments = function.get("arguments") or "{}"
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                raise InvalidParam(
                    "messages", "messages: tool call arguments must be a JSON text"
                ) from None
            calls.append({"type": "function", "function": {**function, "arguments": arguments}})
        turn["tool_calls"] = calls
    return turn
