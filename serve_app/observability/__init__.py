"""Prometheus metrics, OpenTelemetry traces, the engine metrics board."""
