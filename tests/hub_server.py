"""A stand-in for the Hugging Face Hub on loopback: serves checkpoint directories under the
Hub's URL layout (a revision's info, its file tree, `resolve/` for files, the Hub's error
codes), so `huggingface_hub` downloads them as it would from huggingface.co with
`HF_ENDPOINT` pointed here. Counts the files it sends.

    python -m tests.hub_server --repo acme/tiny=models/tiny [--port 8765]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class HubRepo:
    """One repo: its revisions (branch or tag -> checkpoint directory); `token`: private,
    only that bearer token sees it; `gated`: every download is refused as gated."""

    revisions: dict[str, Path]
    token: str | None = None
    gated: bool = False

    def commit(self, revision: str) -> str:
        """The revision's commit sha: a digest of its files' names and contents."""
        digest = hashlib.sha1(revision.encode())
        for path in self.files(revision):
            digest.update(path.encode())
            digest.update(_blob_sha(self.revisions[revision] / path).encode())
        return digest.hexdigest()

    def files(self, revision: str) -> list[str]:
        root = self.revisions[revision]
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def revision_of(self, ref: str) -> str | None:
        """The branch or tag that `ref` (one, or a commit sha) names."""
        if ref in self.revisions:
            return ref
        return next((r for r in self.revisions if self.commit(r) == ref), None)


def _blob_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class HubServer:
    repos: dict[str, HubRepo]
    downloads: Counter = field(default_factory=Counter)  # (repo id, file) -> times sent
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HubServer:
        hub = self

        class Handler(_HubHandler):
            server_hub = hub

        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        # A short poll: `stop` waits for the loop's next look at its flag.
        serve = self._httpd.serve_forever
        threading.Thread(target=serve, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def num_downloads(self) -> int:
        return sum(self.downloads.values())


class _HubHandler(BaseHTTPRequestHandler):
    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo_id, kind, ref = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
            repo = self._repo(repo_id)
            if repo is None:
                return
            revision = self._revision(repo, ref)
            if revision is None:
                return
            if kind == "revision":
                files = repo.files(revision)
                info = {"id": repo_id, "sha": repo.commit(revision), "private": bool(repo.token)}
                self._json({**info, "siblings": [{"rfilename": f} for f in files]}, body)
            elif kind == "tree":
                root = repo.revisions[revision]
                tree = [
                    {"type": "file", "path": f, "size": (root / f).stat().st_size,
                     "oid": _blob_sha(root / f)[:40]}
                    for f in repo.files(revision)
                ]  # fmt: skip
                self._json(tree, body)
            else:
                self._error(404, "EntryNotFound")
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, ref, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo = self._repo(repo_id)
            if repo is None:
                return
            if repo.gated:
                self._error(403, "GatedRepo")
                return
            revision = self._revision(repo, ref)
            if revision is None:
                return
            path = repo.revisions[revision] / name
            if name not in repo.files(revision):
                self._error(404, "EntryNotFound")
                return
            data = path.read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", repo.commit(revision))
            self.send_header("ETag", f'"{_blob_sha(path)}"')
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if body:
                self.server_hub.downloads[(repo_id, name)] += 1
                self.wfile.write(data)
            return
        self._error(404, "EntryNotFound")

    def _repo(self, repo_id: str) -> HubRepo | None:
        repo = self.server_hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound")
            return None
        if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
            # As the Hub: a private repo without its token reads as not found, with a 401.
            self._error(401, "RepoNotFound", "Invalid credentials in Authorization header")
            return None
        return repo

    def _revision(self, repo: HubRepo, ref: str) -> str | None:
        revision = repo.revision_of(ref)
        if revision is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {ref}")
        return revision

    def _json(self, value: object, body: bool) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str = "") -> None:
        data = json.dumps({"error": message or code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repo", action="append", required=True, help="ORG/NAME=DIR (its `main` revision)"
    )
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    repos = {}
    for spec in args.repo:
        repo_id, directory = spec.split("=", 1)
        repos[repo_id] = HubRepo({"main": Path(directory).resolve()})
    hub = HubServer(repos, port=args.port).start()
    print(f"serving {', '.join(repos)} at {hub.endpoint}: export HF_ENDPOINT={hub.endpoint}")
    threading.Event().wait()


if __name__ == "__main__":
    main()
