"""`make serve`'s launcher (serve_app/deploy/launch.py) end to end: deploy.yaml's app on a local
Ray cluster of its own, without Ray's dashboard, metrics and task events; the URL it prints
answers an OpenAI client; SIGTERM ends the cluster with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import openai
import psutil
import pytest
import yaml

from serve_app.deploy.local_cluster import WITHOUT_DASHBOARD_ENV, free_port
from tests.conftest import REPO
from tests.local_serve import deploy_yaml


def _argv(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # gone
        return []


@pytest.mark.own_cluster
@pytest.mark.timeout(300)
def test_make_serve_serves_without_rays_dashboard_and_sigterm_ends_its_cluster(
    tiny_model, tmp_path
):
    config = deploy_yaml()
    config["http_options"]["port"] = free_port()
    config["applications"][0]["args"]["model"] = tiny_model
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    # The ingress's own port, where the launcher looks first: one known to be free (its
    # default, the port after the proxy's, may not be).
    env = dict(os.environ, RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(free_port()))
    launch = subprocess.Popen(
        [sys.executable, "-m", "serve_app.deploy.launch", str(path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []  # read to the end, so that a full pipe never stalls the cluster
    reader = threading.Thread(target=lambda: lines.extend(launch.stdout), daemon=True)
    reader.start()
    cluster: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("dynabatch is serving") for line in lines):
            assert launch.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            assert "NoAvailablePortError" not in "".join(lines[-50:]), "".join(lines)[-3000:]
            time.sleep(0.5)
        ready = next(line for line in lines if line.startswith("dynabatch is serving"))
        base = ready.split(" at ")[1].strip()  # "... `tiny` at http://127.0.0.1:PORT/v1"
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4

        cluster = psutil.Process(launch.pid).children(recursive=True)
        argvs = [_argv(p) for p in cluster]
        titles = [a[0] for a in argvs if a]
        assert any("EngineServer" in t for t in titles), titles
        assert not any(t.startswith("ray-dashboard-") for t in titles), titles  # its modules
        head = [a for a in argvs if any(x.endswith("dashboard/dashboard.py") for x in a)]
        assert head and all("--modules-to-load=UsageStatsHead" in a for a in head), head
        # Without the dashboard, Ray's own metrics and task events are off in its processes.
        engines = [p for p, a in zip(cluster, argvs, strict=True) if a and "EngineServer" in a[0]]
        raylets = [p for p, a in zip(cluster, argvs, strict=True) if a and a[0].endswith("/raylet")]
        assert engines and raylets, titles
        for p in engines + raylets:
            off = {k: p.environ().get(k) for k in WITHOUT_DASHBOARD_ENV}
            assert off == WITHOUT_DASHBOARD_ENV, (p.name(), off)
    finally:
        launch.send_signal(signal.SIGTERM)
        try:
            launch.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
            raise
    _, alive = psutil.wait_procs(cluster, timeout=30)
    assert not [argv[:1] for argv in map(_argv, alive) if argv]  # a zombie has none
