"""EngineRejection: an engine replica's answer instead of a request's first delta."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineRejection:
    """Why an engine replica did not take a request; the ingress maps it to an HTTP status."""

    kind: Literal["overloaded", "invalid_request", "elsewhere", "stopping"]
    message: str
    param: str | None = None
