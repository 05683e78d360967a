"""OpenAI request bodies (validated; unknown fields kept aside, for the ingress to ignore or
reject by name) and response records."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.core.errors import InvalidParam
from engine.core.sampling_params import SamplingParams
from serve_app.openai.structured_fields import GUIDED_FIELDS, structured_output


class _Body(BaseModel):
    # Clients send fields this server does not know (other servers' extensions, newer API
    # versions): they are kept in `model_extra` and listed by `ignored_fields`.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


_NO_DEFAULTS: Mapping[str, float | int] = MappingProxyType({})

# Neutral values of fields accepted for what they would change: anything else is answered
# 400, naming the field, until it is supported.
_NEUTRAL_TOOL_CHOICES = (None, "none", "auto")


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    # vLLM's extension: drop tokens less likely than min_p x the most likely one.
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's extension: divides positive logits of tokens already in the prompt or output.
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    # Any 64-bit pattern, signed or not (sampling reads its low 64 bits).
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    # Ours: false keeps the engine from drafting for this request (same output either way).
    speculate: bool = True
    user: str | None = None
    # vLLM's extension: with the engine's scheduling_policy "priority", lower runs first.
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Structured outputs (serve_app/openai/structured_fields.py): OpenAI's, and vLLM's two
    # spellings.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Chat only (serve_app/openai/tool_calls.py); completions accept their neutral values.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value and any(not -100.0 <= b <= 100.0 for b in value.values()):
            raise ValueError("biases must be in [-100, 100]")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) of the first field we accept syntactically but cannot honour."""
        if self.tools:
            return "tools", "tools are served on /v1/chat/completions"
        if self.tool_choice not in _NEUTRAL_TOOL_CHOICES:
            return "tool_choice", "tool_choice is served on /v1/chat/completions"
        return None

    def ignored_fields(self) -> list[str]:
        """Fields of the body this server does not know, by path (`messages.refusal`)."""
        names = set(self.model_extra or {})
        if self.stream_options is not None:
            names |= {f"stream_options.{n}" for n in self.stream_options.model_extra or {}}
        for message in getattr(self, "messages", ()):
            names |= {f"messages.{n}" for n in message.model_extra or {}}
        return sorted(names)

    def sampling_params(
        self, max_tokens: int, defaults: Mapping[str, float | int] = _NO_DEFAULTS
    ) -> SamplingParams:
        """`defaults`: the model's values (engine/model/generation_defaults.py) of the
        fields this body leaves out."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

        def value(name: str) -> Any:
            if name in defaults and name not in self.model_fields_set:
                return defaults[name]
            return getattr(self, name)

        return SamplingParams(
            temperature=value("temperature"),
            top_k=max(value("top_k"), 0),
            top_p=value("top_p"),
            min_p=value("min_p"),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=value("repetition_penalty"),
            logit_bias=dict(self.logit_bias or {}),
            logprobs=self.requested_logprobs(),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            speculate=self.speculate,
            structured=structured_output(
                self.response_format,
                self.structured_outputs,
                {name: getattr(self, name) for name in GUIDED_FIELDS},
            ),
        )

    def requested_logprobs(self) -> int | None:
        """Alternatives per sampled token the response reports (None: no logprobs)."""
        return None

    @property
    def num_sequences(self) -> int:
        """Sequences the engine generates for this request (`n`, or `best_of` to pick from)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_sequences(self) -> int:
        return max(self.best_of or 1, self.n)

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"
        if self.stream and self.num_sequences > self.n:
            return "best_of", "best_of > n cannot be streamed (as OpenAI)"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; batched prompts are a 400 naming `prompt`."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and all(isinstance(t, int) for t in p):
            return p  # type: ignore[return-value]
        if isinstance(p, list) and len(p) == 1:
            return p[0]  # type: ignore[return-value]
        raise InvalidParam(
            "prompt", "prompt: send one prompt per request (lists of prompts are not supported)"
        )


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidParam("messages", "messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return None  # tools are served here (serve_app/openai/tool_calls.py)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------------------- responses
# Seeded from the OS once per process (and again in a fork). uuid4 reads the OS's randomness
# on every id, a system call that lets go of the GIL: the event loop then waits to get it back.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)  # a forked process draws ids of its own


def new_id(prefix: str) -> str:
    return f"{prefix}-{_ids.getrandbits(128):032x}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(
    message: str, err_type: str = "invalid_request_error", param: str | None = None, code=None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int,
    text: str | None,
    finish_reason: str | None,
    logprobs: dict | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`extra`: more fields of the message (tool_calls, reasoning_content)."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, **(extra or {})},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_delta_choice(
    index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
