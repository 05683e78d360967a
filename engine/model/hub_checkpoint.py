"""A checkpoint named by its Hugging Face Hub id: downloaded into this node's HF cache once,
by whichever process of the node asks first (the others wait on a file lock and reuse it).

What `huggingface_hub` reads from the environment is read here at each call (it reads it at
import): `HF_ENDPOINT` (a mirror or a private hub), `HF_TOKEN`, `HF_HUB_CACHE` / `HF_HOME`,
`HF_HUB_OFFLINE=1` (the cache only)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from engine.core.errors import InvalidParam

logger = logging.getLogger(__name__)

# Config, tokenizer, chat template, generation config and safetensors weights; never pickled
# weights (.bin, .pth, .pt: the loader reads safetensors only, and a pickle runs code on load)
# nor the `original/` copies some repos carry.
WEIGHT_PATTERN = "*.safetensors"
ALLOW_PATTERNS = ["*.json", WEIGHT_PATTERN, "*.model", "*.tiktoken", "*.txt", "*.jinja"]
IGNORE_PATTERNS = ["original/*", "*.bin", "*.pth", "*.pt", "*.gguf", "*.onnx", "*.h5"]


def hub_cache_dir() -> Path:
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def hub_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class _HubAccess:
    """How this process reaches the Hub, read from its environment now."""

    cache: Path
    offline: bool
    endpoint: str
    token: str | None

    @classmethod
    def now(cls) -> _HubAccess:
        endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"
        return cls(hub_cache_dir(), hub_offline(), endpoint, os.environ.get("HF_TOKEN") or None)


@contextlib.contextmanager
def _named_errors(hub: _HubAccess, repo_id: str, revision: str | None, param: str):
    """The Hub's (and the disk's) errors as one InvalidParam naming `param` and the cause."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision or 'main'}"
    try:
        yield
    except GatedRepoError:
        raise InvalidParam(
            param, f"{param}: {repo_id} is gated: accept its terms on the Hub, set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError as exc:
        token = "refused" if hub.token else "unset"
        status = exc.response.status_code if exc.response is not None else 404
        cause = (
            f"unauthorized (HF_TOKEN {token})"
            if status == 401
            else f"not a local directory, nor a repo at {hub.endpoint}"
        )
        raise InvalidParam(param, f"{param}: {repo_id}: {cause}") from None
    except RevisionNotFoundError:
        raise InvalidParam(param, f"{param}: {repo_id} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        cause = "HF_HUB_OFFLINE is set" if hub.offline else f"{hub.endpoint} could not be reached"
        raise InvalidParam(
            param, f"{param}: {at} is not in the cache at {hub.cache} and {cause}"
        ) from None
    except HfHubHTTPError as exc:
        raise InvalidParam(param, f"{param}: {repo_id}: the Hub answered {exc}") from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise InvalidParam(param, f"{param}: {at}: disk full in {hub.cache}") from None
        raise


def _has_weights(files: list[str], at: str, param: str) -> None:
    if not any(f.endswith(".safetensors") and "/" not in f for f in files):
        raise InvalidParam(
            param, f"{param}: {at} has no safetensors weights (pickled weights are not loaded)"
        )


def fetched_patterns(weights: bool) -> list[str]:
    """What a fetch takes: everything a replica reads, or (an ingress: config, tokenizer and
    chat template) all but the weights."""
    return ALLOW_PATTERNS if weights else [p for p in ALLOW_PATTERNS if p != WEIGHT_PATTERN]


def hub_checkpoint(repo_id: str, revision: str | None, param: str, weights: bool = True) -> Path:
    """The local snapshot of `repo_id` at `revision` (null: main); without the weights
    where `weights` is false. Raises InvalidParam naming `param` with the cause: not found,
    unauthorized, gated, no such revision, offline and not cached, no safetensors weights,
    disk full."""
    from filelock import FileLock
    from huggingface_hub import snapshot_download

    hub = _HubAccess.now()
    at = f"{repo_id}@{revision or 'main'}"
    locks = hub.cache / ".dynabatch-locks"
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / (repo_id.replace("/", "--") + ".lock")))
    with lock, _named_errors(hub, repo_id, revision, param):  # one download per node
        started = time.monotonic()
        origin = "the cache" if hub.offline else hub.endpoint
        logger.info("%s: %s from %s into %s", param, at, origin, hub.cache)
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hub.cache,
                endpoint=hub.endpoint,
                token=hub.token,
                local_files_only=hub.offline,
                allow_patterns=fetched_patterns(weights),
                ignore_patterns=IGNORE_PATTERNS,
            )
        )
    if weights:
        _has_weights([p.name for p in path.glob(WEIGHT_PATTERN)], at, param)
    logger.info("%s: %s is %s (%.1f s)", param, at, path, time.monotonic() - started)
    return path


def check_hub_repo(repo_id: str, revision: str | None, param: str) -> None:
    """That `repo_id` at `revision` can be served, without fetching it: its file list from
    the Hub (offline: the cache's snapshot). Raises as `hub_checkpoint` does."""
    from huggingface_hub import HfApi, snapshot_download

    hub = _HubAccess.now()
    with _named_errors(hub, repo_id, revision, param):
        if hub.offline:
            path = snapshot_download(
                repo_id, revision=revision, cache_dir=hub.cache, local_files_only=True
            )
            files = [p.name for p in Path(path).iterdir()]
        else:
            api = HfApi(endpoint=hub.endpoint, token=hub.token)
            files = api.list_repo_files(repo_id, revision=revision)
    _has_weights(files, f"{repo_id}@{revision or 'main'}", param)
