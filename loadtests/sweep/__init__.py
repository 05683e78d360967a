"""Latency-throughput sweeps of a running server (`python -m loadtests.bench_serve sweep`): its
levels, prompts and report."""
