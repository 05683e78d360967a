"""A checkpoint named by its Hugging Face Hub id: downloaded into this node's HF cache once,
by whichever process of the node asks first (the others wait on a file lock and reuse it).

What `huggingface_hub` reads from the environment is read here at each call (it reads it at
import): `HF_ENDPOINT` (a mirror or a private hub), `HF_TOKEN`, `HF_HUB_CACHE` / `HF_HOME`,
`HF_HUB_OFFLINE=1` (the cache only)."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

from engine.core.errors import InvalidParam

logger = logging.getLogger(__name__)

# Config, tokenizer, chat template, generation config and safetensors weights; never pickled
# weights (.bin, .pth, .pt: the loader reads safetensors only, and a pickle runs code on load)
# nor the `original/` copies some repos carry.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
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


def hub_checkpoint(repo_id: str, revision: str | None, param: str) -> Path:
    """The local snapshot of `repo_id` at `revision` (null: main). Raises InvalidParam
    naming `param` with the cause: not found, unauthorized, gated, no such revision, offline
    and not cached, no safetensors weights, disk full."""
    from filelock import FileLock
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    offline = hub_offline()
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"
    at = f"{repo_id}@{revision or 'main'}"
    locks = cache / ".dynabatch-locks"
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / (repo_id.replace("/", "--") + ".lock")))
    with lock:  # one download per node; the others find it cached
        started = time.monotonic()
        origin = "the cache" if offline else endpoint
        logger.info("%s: %s from %s into %s", param, at, origin, cache)
        try:
            path = Path(
                snapshot_download(
                    repo_id,
                    revision=revision,
                    cache_dir=cache,
                    endpoint=endpoint,
                    token=os.environ.get("HF_TOKEN") or None,
                    local_files_only=offline,
                    allow_patterns=ALLOW_PATTERNS,
                    ignore_patterns=IGNORE_PATTERNS,
                )
            )
        except GatedRepoError:
            raise InvalidParam(
                param, f"{param}: {repo_id} is gated: accept its terms on the Hub, set HF_TOKEN"
            ) from None
        except RepositoryNotFoundError as exc:
            token = "refused" if os.environ.get("HF_TOKEN") else "unset"
            why = f"unauthorized (HF_TOKEN {token})"
            status = exc.response.status_code if exc.response is not None else 404
            cause = why if status == 401 else f"not a local directory, nor a repo at {endpoint}"
            raise InvalidParam(param, f"{param}: {repo_id}: {cause}") from None
        except RevisionNotFoundError:
            raise InvalidParam(param, f"{param}: {repo_id} has no revision {revision!r}") from None
        except LocalEntryNotFoundError:
            cause = "HF_HUB_OFFLINE is set" if offline else f"{endpoint} could not be reached"
            raise InvalidParam(
                param, f"{param}: {at} is not in the cache at {cache} and {cause}"
            ) from None
        except HfHubHTTPError as exc:
            raise InvalidParam(param, f"{param}: {repo_id}: the Hub answered {exc}") from None
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise InvalidParam(param, f"{param}: {at}: disk full in {cache}") from None
            raise
    if not any(path.glob("*.safetensors")):
        raise InvalidParam(
            param, f"{param}: {at} has no safetensors weights (pickled weights are not loaded)"
        )
    logger.info("%s: %s is %s (%.1f s)", param, at, path, time.monotonic() - started)
    return path
