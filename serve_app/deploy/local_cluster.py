"""A local Ray instance plus Serve on a free port, with the flags RAY_NOTES.md measured as
right for small machines (tests and benchmarks; `make serve` uses `serve run` instead)."""

from __future__ import annotations

import os
import socket
from typing import Any

_BIND_ATTEMPTS = 3

# deploy.yaml's top-level logging_config, which `serve run` applies to every app's replicas;
# serve.run takes it per app (serve.start's covers only the controller and proxies).
APP_LOGGING_CONFIG = {"enable_access_log": False}

# The environment a local cluster starts with (`make serve` and start_local_serve; what is
# already set wins), which its processes inherit.
LOCAL_CLUSTER_ENV = {
    # Ray's default worker nice level (15) starves replicas next to anything else.
    "RAY_worker_niceness": "0",
    # A hung replica never finishes a graceful stop: replace it at once (docs/serving.md).
    "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1",
    # Serve's direct ingress: each ingress replica also serves HTTP on a port of its own
    # (ingress_url), one Ray hop less per chunk than through the proxy, which keeps working.
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    # Its replicas wait this long for load balancers before stopping; there are none here.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    # Serve's controller looks over the cluster every 0.1 s by default, the largest share of
    # an idle app's CPU, which on a CPU host the engine's steps lose: every 0.25 s halves it,
    # for at most 0.15 s more before a deploy, a health check or an autoscaling decision
    # takes effect (docs/serving.md, "CPU hosts").
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25",
    # Serve's replicas and handles hand their own metrics to Ray's every 0.1 s by default;
    # each second is as often as a scrape reads them.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}

# And without Ray's dashboard, which shows them: Ray's own metrics (its Prometheus port; the
# app's /metrics comes from the engine metrics board, not from them) and its task events
# (`ray list tasks`, the dashboard's task views), which cost every process and every actor
# call a little CPU, the engine's steps on a CPU host included (docs/serving.md, "CPU hosts").
WITHOUT_DASHBOARD_ENV = {
    "RAY_enable_metrics_collection": "0",
    "RAY_task_events_report_interval_ms": "0",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_serve(log_level: str = "INFO", num_gpus: int | None = None) -> int:
    """Start Ray (4 logical CPUs, no dashboard, 256 MB object store; `num_gpus`, or as many
    as Ray finds) and Serve's HTTP proxy on a free localhost port; returns the port."""
    for name, value in (LOCAL_CLUSTER_ENV | WITHOUT_DASHBOARD_ENV).items():
        os.environ.setdefault(name, value)
    import ray
    from ray import serve

    ray.init(
        # Never another cluster left on this machine (/tmp/ray/ray_current_cluster names the
        # last one `ray start` or a test's Cluster began, which a bare init would join).
        address="local",
        num_cpus=4,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 << 20,
        configure_logging=False,
    )
    # A port free a moment ago can be taken (as the local end of some Ray process's
    # connection) before the proxy binds it: seen once in CI. Then try another.
    for attempt in range(1, _BIND_ATTEMPTS + 1):
        port = free_port()
        try:
            serve.start(
                http_options={"host": "127.0.0.1", "port": port},
                logging_config=APP_LOGGING_CONFIG | {"log_level": log_level},
            )
        except Exception as exc:  # a RayTaskError wrapping the proxy's bind failure
            if "Failed to bind" not in str(exc) or attempt == _BIND_ATTEMPTS:
                raise
            serve.shutdown()
        else:
            return port


def run_app(app: Any, name: str, route_prefix: str = "/") -> None:
    """serve.run `app` as deploy.yaml would: no access-log line per request in its replicas."""
    from ray import serve

    serve.run(app, name=name, route_prefix=route_prefix, logging_config=APP_LOGGING_CONFIG)


def ingress_url(app_name: str, proxy_port: int) -> str:
    """Where clients reach `app_name`: with Serve's direct ingress
    (RAY_SERVE_ENABLE_DIRECT_INGRESS=1) the ingress replica serves HTTP on its own port and
    the proxy hop is skipped; otherwise the proxy on `proxy_port`."""
    return ingress_urls(app_name, proxy_port)[0]


def ingress_urls(app_name: str, proxy_port: int) -> list[str]:
    """Every ingress replica's own URL under direct ingress (a load test spreads its clients
    over them, as a load balancer would); otherwise the proxy's."""
    import ray
    from ray.serve.context import _get_global_client

    # Serve's controller lists where each app's HTTP traffic goes: the ingress replicas' ports
    # under direct ingress, the proxies otherwise.
    controller = _get_global_client()._controller
    urls = [
        f"http://127.0.0.1:{target.port}"  # local: the host we bound
        for group in ray.get(controller.get_target_groups.remote(app_name))
        if group.protocol == "HTTP"
        for target in group.targets
        if target.port != proxy_port
    ]
    return urls or [f"http://127.0.0.1:{proxy_port}"]


def stop_local_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
