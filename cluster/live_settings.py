"""Settings applied to a running app (POST /v1/cluster/settings), in force until its next
deploy: one record per model, in Ray's internal key-value store (GCS), where the three that
act on it read it: the ingress (GET shows it), the model's cluster controller (its batching
policy and limits; read again when it restarts) and the autoscaling rule, which runs in
Serve's controller (its targets and delays).

A record names the deployed args it amends (`deployed`, a fingerprint of the model's args
as deployed); a reader ignores a record of other args, so a redeploy with new args starts
from them, and one with the same args keeps what was applied.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

_NAMESPACE = "dynabatch"


def fingerprint(deployed_args: dict[str, Any]) -> str:
    """The fingerprint of a model's args as deployed (AppArgs.model_dump())."""
    text = json.dumps(deployed_args, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def key(app_name: str, engine_deployment: str) -> str:
    """The record of the model served by deployment `engine_deployment` of app `app_name`."""
    return f"settings/{app_name}/{engine_deployment}"


@dataclass(frozen=True)
class LiveSettings:
    """What is in force for one model: engine limits, its batching policy (BatchingArgs'
    fields), its autoscaling rule (AutoscaleConfig's fields; None: a fixed count)."""

    deployed: str  # fingerprint() of the args it amends
    version: int  # 0: as deployed; each apply adds one
    applied_at: float | None  # wall-clock seconds of the last apply
    max_num_seqs: int
    max_num_batched_tokens: int
    batching: dict[str, Any]
    autoscaling: dict[str, Any] | None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> LiveSettings:
        return cls(**json.loads(text))


def read(record_key: str, deployed: str) -> LiveSettings | None:
    """The record at `record_key` if one amends the args of fingerprint `deployed`; None
    where there is none, it amends other args, or the store cannot be read."""
    from ray.experimental import internal_kv

    try:
        raw = internal_kv._internal_kv_get(record_key, namespace=_NAMESPACE)
    except Exception:  # GCS unreachable for a moment: what is in force stays
        return None
    if raw is None:
        return None
    settings = LiveSettings.from_json(raw)
    return settings if settings.deployed == deployed else None


def write(record_key: str, settings: LiveSettings) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(record_key, settings.to_json(), namespace=_NAMESPACE)
