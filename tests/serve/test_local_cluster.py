"""start_local_serve survives a proxy port taken between choosing it and binding it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

# Runs in its own process: the serve tests' session already holds a Ray instance here.
SCRIPT = """
import socket, urllib.request
import serve_app.deploy.local_cluster as lc

taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
busy = taken.getsockname()[1]
offers = [busy]
real_free_port = lc.free_port
lc.free_port = lambda: offers.pop() if offers else real_free_port()
port = lc.start_local_serve(log_level="WARNING")
try:
    assert port != busy, port
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/-/routes", timeout=30)
    except urllib.error.HTTPError as exc:  # any HTTP answer proves the proxy listens
        print("status", exc.code)
    print("PORT", port, "BUSY", busy)
finally:
    lc.stop_local_serve()
"""


@pytest.mark.own_cluster
def test_a_taken_proxy_port_is_retried_on_another():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PORT" in proc.stdout
