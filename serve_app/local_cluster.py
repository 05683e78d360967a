"""A local Ray instance plus Serve on a free port, with the flags RAY_NOTES.md measured as
right for small machines (tests and benchmarks; `make serve` uses `serve run` instead)."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_serve(log_level: str = "INFO") -> int:
    """Start Ray (4 logical CPUs, no dashboard, 256 MB object store) and Serve's HTTP proxy
    on a free localhost port; returns the port."""
    # Ray's default worker nice level (15) starves replicas next to anything else.
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray
    from ray import serve

    port = free_port()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 << 20,
        configure_logging=False,
    )
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        logging_config={"enable_access_log": False, "log_level": log_level},
    )
    return port


def stop_local_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
