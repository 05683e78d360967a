"""The Ray Serve application: OpenAI-compatible ingress routing to engine replicas."""

from serve_app.deploy.builder import build_app

__all__ = ["build_app"]
