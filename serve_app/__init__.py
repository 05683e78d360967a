"""The Ray Serve application: OpenAI-compatible ingress routing to engine replicas.

`build_app` (deploy.yaml's `import_path: serve_app:build_app`) is imported when first asked
for: the app's tables (serve_app.observability, serve_app.openai.responses) are unpickled in
the AppTables actor, which then imports this package, and should not import the whole app
(the engine and torch) with it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from serve_app.deploy.builder import build_app

        return build_app
    raise AttributeError(f"module 'serve_app' has no attribute {name!r}")
