"""Prompts to token ids at the ingress: the tokenizer and the model's chat template."""

from __future__ import annotations

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

    def chat(self, messages: list[Any]) -> list[int]:
        """The chat template applied to the messages (text content), with the generation
        prompt."""
        turns = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                turns, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises on role orders a template does not allow
            raise InvalidParam(
                "messages", f"messages: the chat template rejected them: {exc}"
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)
