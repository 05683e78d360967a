"""Per-request generation parameters and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.core.errors import InvalidParam

# Below this a temperature is greedy (as vLLM): dividing logits by it overflows float32.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs


StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
# An embedding request's pooling of the prompt's final hidden states (normed): its last
# token's, or the mean over its tokens.
Pooling = Literal["last", "mean"]


@dataclass(frozen=True)
class StructuredOutput:
    """Output held to a grammar: `json` (a JSON schema, as JSON text), `json_object` (any JSON
    object), `regex`, `choice` (exactly one of `choices`), `grammar` (EBNF text). `param` is
    the request field it came from, named by errors."""

    kind: StructuredKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    param: str = "response_format"


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    `temperature` below 1e-5 means greedy. `top_k <= 0`, `top_p == 1` and `min_p == 0`
    disable those filters (min_p drops tokens less likely than min_p x the most likely one).
    The penalties and `logit_bias` change the logits before greedy or random choice:
    presence and frequency penalties subtract for tokens already generated (once, and per
    occurrence), the repetition penalty divides positive logits (multiplies negative ones)
    of tokens in the prompt or the output, `logit_bias` adds to given token ids.
    Stop strings are matched on the detokenized text and are not included in it.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Log-probabilities of the sampled tokens, with this many alternatives each (None: none).
    logprobs: int | None = None
    # The same for the prompt's tokens after its first (a request asking for them computes
    # its whole prompt: no prefix cache hit).
    prompt_logprobs: int | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Every token the grammar allows, and the request ends at its accept state.
    structured: StructuredOutput | None = None
    # False: never drafted for, where the engine speculates (the output is the same either
    # way; a request may still want steady per-token latency).
    speculate: bool = True
    # An embedding request: its prompt is computed (prefill only, every token for "mean"),
    # the pooled final hidden state (L2-normalized with `normalize`) is its output, and it
    # ends there, generating nothing.
    pooling: Pooling | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """True when a penalty reads the tokens the request has seen."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise InvalidParam naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidParam(
                "max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidParam(
                "min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        if self.min_tokens > self.max_tokens:
            raise InvalidParam(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if self.temperature < 0.0:
            raise InvalidParam("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidParam(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise InvalidParam(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
            raise InvalidParam("logit_bias", "logit_bias keys must be token ids (integers >= 0)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                raise InvalidParam(
                    name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int):
            raise InvalidParam("top_k", f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidParam("seed", f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParam("stop", "stop must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids", "stop_token_ids must hold non-negative integers")
        if self.pooling not in (None, "last", "mean"):
            raise InvalidParam("pooling", f"pooling must be last or mean, got {self.pooling!r}")

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position is computed (no prefix cache hit): prompt logprobs and mean
        pooling read them all."""
        return self.prompt_logprobs is not None or self.pooling == "mean"


def check_in_vocabulary(name: str, token_ids, vocab: int) -> None:
    """Raise InvalidParam naming `name` if a token id is outside [0, vocab)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidParam(name, f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
