"""Where a checkpoint comes from, as a user names it: a local directory, a Hugging Face Hub id
(`org/name`), or an object-store URI (`s3://bucket/prefix/`, `gs://…`); and the local
directory it is on this node (`local_checkpoint`), fetched there first where it is not."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from engine.core.errors import InvalidParam

BUCKET_SCHEMES = ("s3", "gs", "gcs")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

SourceKind = Literal["local", "hub", "bucket"]


def source_kind(source: str, param: str = "model") -> SourceKind:
    """An existing path is local; `scheme://` an object store; `org/name` a Hub id; any
    other name a local path (which the loader then finds missing)."""
    if "://" in source:
        scheme = source.split("://", 1)[0]
        if scheme not in BUCKET_SCHEMES:
            raise InvalidParam(
                param,
                f"{param}: {source!r}: unknown scheme {scheme!r} (a local directory, a Hub id "
                f"org/name, or one of {', '.join(s + '://' for s in BUCKET_SCHEMES)})",
            )
        return "bucket"
    if Path(source).expanduser().exists():
        return "local"
    return "hub" if _HUB_ID.fullmatch(source) else "local"


def served_name(source: str) -> str:
    """The model id clients send when none is configured: a Hub id as it is (as vLLM), else
    the directory's (or the prefix's) last name."""
    if "://" not in source and source_kind(source) == "hub":
        return source
    return source.rstrip("/").rsplit("/", 1)[-1]


def local_checkpoint(
    source: str,
    param: str = "model",
    revision: str | None = None,
    endpoint_url: str | None = None,
    weights: bool = True,
) -> str:
    """The local checkpoint directory of `source` (itself where local). A Hub id is fetched
    at `revision`; an s3:// URI from `endpoint_url` where set (S3-compatible stores);
    `weights` false fetches all but the weights (what an ingress reads). Raises InvalidParam
    naming `param` with the cause."""
    kind = source_kind(source, param)
    if kind == "hub":
        from engine.model.hub_checkpoint import hub_checkpoint

        return str(hub_checkpoint(source, revision, param, weights))
    if kind == "bucket":
        from engine.model.bucket_checkpoint import bucket_checkpoint

        return str(bucket_checkpoint(source, endpoint_url, param, weights))
    return source


def check_source(
    source: str,
    param: str = "model",
    revision: str | None = None,
    endpoint_url: str | None = None,
) -> None:
    """Where `source` is a Hub id or a bucket: that it can be fetched (it exists, is
    reachable with the credentials here, has safetensors weights), without fetching it; a
    deploy checks before its replicas start. A local directory is not checked: it need be
    only on the nodes that run the replicas. Raises as `local_checkpoint` does."""
    kind = source_kind(source, param)
    if kind == "hub":
        from engine.model.hub_checkpoint import check_hub_repo

        check_hub_repo(source, revision, param)
    elif kind == "bucket":
        from engine.model.bucket_checkpoint import check_bucket

        check_bucket(source, endpoint_url, param)
