"""The running app as the tuner talks to it: its recorded traffic (GET /v1/cluster/trace,
for `--from-url`) and the settings it chose, applied live (POST /v1/cluster/settings, for
`--apply`). Both behind the app's API key."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any


def _call(url: str, api_key: str | None, what: str, body: dict[str, Any] | None = None) -> bytes:
    """The app's answer to a GET (`body` None) or a POST of `body` as JSON; raises ValueError
    with its answer when it refuses, or why it could not be reached."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        raise ValueError(f"{what}: {exc.code} {exc.read().decode(errors='replace')}") from None
    except urllib.error.URLError as exc:
        raise ValueError(f"{what} {url}: {exc.reason}") from None


def fetch_trace(url: str, since: str, api_key: str | None, out: Path) -> Path:
    """The app's recorded traffic since `since`, saved as `out`/trace.jsonl."""
    query = urllib.parse.urlencode({"since": since})
    body = _call(f"{url.rstrip('/')}/v1/cluster/trace?{query}", api_key, "--from-url")
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace.jsonl").write_bytes(body)
    return out / "trace.jsonl"


def apply_settings(
    url: str, args: dict[str, Any], api_key: str | None, model: str | None = None
) -> dict[str, Any]:
    """`args` (deploy.yaml `args:` keys, as tuned.yaml has them) applied to the running app
    (`model`: the served model, where it serves several); returns the settings now in force.
    `autoscaling.initial_replicas` is left out: it means something only at a start."""
    fragment = {k: v for k, v in args.items() if k not in ("model", "served_model_name")}
    if "autoscaling" in fragment:
        fragment["autoscaling"] = {
            k: v for k, v in fragment["autoscaling"].items() if k != "initial_replicas"
        }
    if model is not None:
        fragment["model"] = model
    answer = _call(f"{url.rstrip('/')}/v1/cluster/settings", api_key, "--apply", fragment)
    return json.loads(answer)
