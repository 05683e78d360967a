"""What the OpenAI API edge lets in: deploy.yaml's `api:` section, and the ingress's checks
of a request before it is parsed (size) and after (fields this server does not know)."""

from __future__ import annotations

import hmac
import logging
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-dynabatch-ignored-fields"


class ApiArgs(BaseModel):
    """deploy.yaml `api:`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unknown_fields: Literal["ignore", "reject"] = Field(
        "ignore",
        description="Request fields this server does not know: ignore (logged once per name, "
        "and named in the x-dynabatch-ignored-fields response header), or reject (400 naming "
        "the field).",
    )
    max_request_bytes: int = Field(
        4 << 20, ge=1024, description="Largest request body; a larger one is answered 413."
    )
    max_messages: int = Field(
        1024, ge=1, description="Most chat messages in one request (400 naming `messages`)."
    )
    stored_responses: int = Field(
        10000,
        ge=0,
        description="Responses API: most responses kept for previous_response_id and GET "
        "/v1/responses/{id} (the least recently used leave first), in a store every ingress "
        "replica shares. 0: none kept.",
    )
    stored_response_ttl_s: float = Field(
        86400.0, gt=0, description="Responses API: how long a stored response is kept."
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="Keys clients must send as `Authorization: Bearer <key>` on /v1/*, "
        "/tokenize and /detokenize (401 otherwise). With none here or in api_keys_env, no key "
        "is asked.",
    )
    api_keys_env: str = Field(
        "DYNABATCH_API_KEYS",
        description="Environment variable of the ingress replicas holding more keys, "
        "comma-separated (keeps them out of deploy.yaml).",
    )
    max_unsent_tokens: int | None = Field(
        4096,
        ge=1,
        description="Tokens of one stream that may wait at the ingress for a client that reads "
        "slower than they come; past it, once the client took none of them for 2 s, the "
        "request is aborted and its connection closed. "
        "Applies where the ingress serves HTTP itself (Serve's direct ingress); through "
        "Serve's proxy, the proxy buffers instead. Null: no bound.",
    )
    keys_for_health_and_metrics: bool = Field(
        False, description="Ask for a key on /health and /metrics too."
    )
    tool_call_parser: Literal["hermes", "llama3_json"] = Field(
        "hermes",
        description="How the model writes tool calls when tool_choice is auto: hermes "
        "(Hermes, Qwen: <tool_call>{...}</tool_call> blocks) or llama3_json (Llama 3: a JSON "
        '{"name", "parameters"} object). required and named tool choices are held by a grammar.',
    )
    reasoning_parser: Literal["none", "think"] = Field(
        "none",
        description="think: the model's leading <think>...</think> (reasoning models: Qwen3, "
        "DeepSeek-R1) is returned as the chat message's reasoning_content, not its content.",
    )

    def keys(self) -> frozenset[str]:
        """The configured keys and those of the environment variable, read now."""
        from_env = os.environ.get(self.api_keys_env, "").split(",")
        return frozenset(k.strip() for k in [*self.api_keys, *from_env] if k.strip())

    def needs_key(self, path: str) -> bool:
        if path.startswith(("/v1/", "/tokenize", "/detokenize")):
            return True
        return self.keys_for_health_and_metrics and path in ("/health", "/metrics")


def key_accepted(authorization: str | None, keys: frozenset[str]) -> bool:
    scheme, _, key = (authorization or "").partition(" ")
    # compare_digest for every key: the time taken tells nothing about a key.
    matches = [hmac.compare_digest(key.strip().encode(), k.encode()) for k in keys]
    return scheme.lower() == "bearer" and any(matches)


class IgnoredFields:
    """Logs each unknown field name once per ingress replica."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def note(self, names: list[str]) -> None:
        new = [n for n in names if n not in self._logged]
        if new:
            self._logged.update(new)
            logger.info("ignoring request fields this server does not know: %s", ", ".join(new))
