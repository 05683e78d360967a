"""EngineRejection: an engine replica's answer instead of a request's first delta."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineRejection:
    """Why an engine replica did not take a request; the ingress maps it to an HTTP status."""

    # (channel_lost: after the first delta, on the call of a request whose delta link broke)
    kind: Literal["overloaded", "invalid_request", "elsewhere", "stopping", "channel_lost"]
    message: str
    param: str | None = None
