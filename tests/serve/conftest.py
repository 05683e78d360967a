"""The Serve apps these tests run against: tests/local_serve.py (its `serve_cluster` fixture
is registered in tests/conftest.py, shared with tests/chaos)."""
