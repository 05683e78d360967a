"""Our packages' log records in a replica's own log: Serve gives its replicas a logger
(`ray.serve`: the replica's stderr, which `serve run` shows, and its log file under the
session's logs/serve/), while Ray's workers leave the root logger at WARNING, where an
engine's start (the model fetched, the attention backend chosen, its threads, the KV cache's
size) would be dropped."""

from __future__ import annotations

import logging

PACKAGES = ("engine", "serve_app", "cluster")


def into_replica_log(level: int = logging.INFO) -> None:
    """From now on, this process's records of our packages at `level` and up go where Serve's
    replica logger writes, with the replica's context (Serve's handlers add it)."""
    handlers = logging.getLogger("ray.serve").handlers
    for name in PACKAGES:
        package = logging.getLogger(name)
        package.setLevel(level)
        for handler in handlers:
            if handler not in package.handlers:
                package.addHandler(handler)
        package.propagate = not handlers  # outside a replica: as before
