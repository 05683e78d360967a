"""What a CPU engine replica's process starts with: libgomp's short spin before its OpenMP
threads sleep (serve_app/deploy/builder.py, docs/serving.md "CPU hosts")."""

from __future__ import annotations

from pathlib import Path


def test_cpu_engine_replicas_spin_briefly_before_their_threads_sleep(serve_cluster):
    stats = serve_cluster.replica_stats("llm", 2)
    assert len(stats) == 2
    for s in stats.values():
        environ = Path(f"/proc/{s['pid']}/environ").read_bytes().split(b"\0")
        assert b"GOMP_SPINCOUNT=1000" in environ, s["replica_id"]
