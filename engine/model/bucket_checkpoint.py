"""A checkpoint in an object store (`s3://bucket/prefix/`, `gs://…`): copied into a local
cache directory keyed by its URI and its objects' ETags, once per node (a file lock), and
reused while no object changed; an object changed since is fetched again, the unchanged ones
are linked from the copy before. Through fsspec (s3fs, gcsfs): credentials as those libraries
find them (environment, config files, instance profile)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from fnmatch import fnmatch
from pathlib import Path

from engine.core.errors import InvalidParam
from engine.model.hub_checkpoint import IGNORE_PATTERNS, WEIGHT_PATTERN, fetched_patterns

logger = logging.getLogger(__name__)

MANIFEST = ".objects.json"  # a finished copy's objects: relative key -> ETag


def bucket_cache_dir() -> Path:
    root = os.environ.get("DYNABATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dynabatch"
    )
    return Path(root) / "buckets"


def _wanted(key: str) -> bool:
    return any(fnmatch(key, p) for p in fetched_patterns(True)) and not any(
        fnmatch(key, p) for p in IGNORE_PATTERNS
    )


def _filesystem(uri: str, endpoint_url: str | None, param: str):
    import fsspec

    scheme = uri.split("://", 1)[0]
    options = {}
    if endpoint_url and scheme == "s3":
        options["endpoint_url"] = endpoint_url
    try:
        return fsspec.filesystem(scheme, **options)
    except ImportError:
        extra = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs"}.get(scheme, scheme)
        cause = f"{scheme}:// needs {extra} (pip install {extra})"
        raise InvalidParam(param, f"{param}: {cause}") from None


def _listing(fs, uri: str, param: str, weights: bool = True) -> dict[str, str]:
    """The checkpoint's objects under `uri` (without its weights where `weights` is false):
    relative key -> ETag."""
    root = uri.split("://", 1)[1].rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        raise InvalidParam(param, f"{param}: {uri}: no such bucket") from None
    except PermissionError as exc:
        raise InvalidParam(param, f"{param}: {uri}: access denied ({exc})") from None
    except Exception as exc:  # botocore's NoCredentialsError and its kin carry no common base
        if "credential" in type(exc).__name__.lower() or "credential" in str(exc).lower():
            raise InvalidParam(param, f"{param}: {uri}: no credentials found ({exc})") from None
        raise
    objects = {}
    for path, info in found.items():
        key = path[len(root) :].lstrip("/")
        if info.get("type") == "file" and _wanted(key):
            objects[key] = str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or "")
    if not objects:
        raise InvalidParam(param, f"{param}: {uri}: nothing under this prefix")
    if not {"config.json", "adapter_config.json"} & objects.keys():  # a model's, an adapter's
        raise InvalidParam(param, f"{param}: {uri}: no config.json under this prefix")
    if not any(k.endswith(".safetensors") for k in objects):
        raise InvalidParam(
            param, f"{param}: {uri} has no safetensors weights (pickled weights are not loaded)"
        )
    return {k: etag for k, etag in objects.items() if weights or not fnmatch(k, WEIGHT_PATTERN)}


def check_bucket(uri: str, endpoint_url: str | None, param: str) -> None:
    """That the checkpoint at `uri` can be copied, without copying it (its listing).
    Raises as `bucket_checkpoint` does."""
    _listing(_filesystem(uri, endpoint_url, param), uri, param)


def bucket_checkpoint(uri: str, endpoint_url: str | None, param: str, weights: bool = True) -> Path:
    """The local copy of the checkpoint at `uri` (without its weights where `weights` is
    false). Raises InvalidParam naming `param`: no library for the scheme, no credentials,
    no such bucket, nothing under the prefix, no safetensors weights, disk full."""
    from filelock import FileLock

    fs = _filesystem(uri, endpoint_url, param)
    home = bucket_cache_dir() / hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home / ".lock")):
        started = time.monotonic()
        objects = _listing(fs, uri, param, weights)
        digest = hashlib.sha256(json.dumps(sorted(objects.items())).encode()).hexdigest()[:16]
        target = home / digest
        if (target / MANIFEST).is_file():
            logger.info("%s: %s is cached at %s", param, uri, target)
            return target
        earlier = _earlier_copies(home)
        partial = home / f".partial-{digest}"
        shutil.rmtree(partial, ignore_errors=True)
        root = uri.split("://", 1)[1].rstrip("/")
        fetched = 0
        try:
            for key, etag in sorted(objects.items()):
                dest = partial / key
                dest.parent.mkdir(parents=True, exist_ok=True)
                same = earlier.get((key, etag))
                if same is not None:
                    os.link(same, dest)
                    continue
                fs.get(f"{root}/{key}", str(dest))
                fetched += 1
            (partial / MANIFEST).write_text(json.dumps(objects))
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if exc.errno == errno.ENOSPC:
                raise InvalidParam(param, f"{param}: {uri}: disk full in {home}") from None
            raise
        partial.rename(target)
    logger.info(
        "%s: %s copied to %s (%d objects fetched, %d reused; %.1f s)",
        param, uri, target, fetched, len(objects) - fetched, time.monotonic() - started,
    )  # fmt: skip
    return target


def _earlier_copies(home: Path) -> dict[tuple[str, str], Path]:
    """(key, ETag) -> a file of a finished earlier copy holding that object."""
    files: dict[tuple[str, str], Path] = {}
    for manifest in home.glob(f"*/{MANIFEST}"):
        for key, etag in json.loads(manifest.read_text()).items():
            if etag:
                files[(key, etag)] = manifest.parent / key
    return files
