"""The app's code as one zip for Ray's runtime_env, so worker nodes need no install of ours.

    python -m serve_app.deploy.code_bundle --out dist/dynabatch.zip

The zip holds one top-level folder with our packages (engine, serve_app, cluster) and their
package data (the native kernels' C sources, built on each node at first use). Put it where
every node can read it (s3://, gs://, https://; file:// on a shared filesystem) and name it as
the application's `runtime_env.working_dir` in deploy.yaml (docs/cluster.md, "Multi-node").
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "serve_app", "cluster")
_SKIPPED_DIRS = {"__pycache__", ".pytest_cache"}
_SKIPPED_SUFFIXES = {".pyc", ".so", ".o"}


def bundle_files(root: Path = ROOT) -> list[Path]:
    """Every file of the packages the app imports, relative to `root`."""
    files = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*")):
            relative = path.relative_to(root)
            if not path.is_file() or _SKIPPED_DIRS.intersection(relative.parts):
                continue
            if path.suffix not in _SKIPPED_SUFFIXES:
                files.append(relative)
    return files


def write_bundle(out: Path, top: str = "dynabatch", root: Path = ROOT) -> Path:
    """The zip at `out` (one top-level folder `top`, as Ray's working_dir URIs want)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for relative in bundle_files(root):
            zf.write(root / relative, f"{top}/{relative.as_posix()}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serve_app.deploy.code_bundle")
    parser.add_argument("--out", default="dist/dynabatch.zip")
    opts = parser.parse_args(argv)
    out = write_bundle(Path(opts.out))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MB): runtime_env.working_dir")


if __name__ == "__main__":
    main()
