#!/usr/bin/env bash
# What the GPU machine's image lacks, at the versions of this checkout's .venv, into .whl/
# (git-ignored); name `.whl` in the device tool's `carry`, and tests/gpu/on_device.sh installs
# it there under /tmp/site:
#   - wheels of xgrammar and what it needs (the grammar tests; without them they skip);
#   - serving-site.tar.xz: Ray Serve, FastAPI, pydantic, the openai client and the rest the
#     Serve app needs, installed for the device's Python and packed without what a local
#     Serve app never loads (Ray's Java jar, dashboard client, RLlib, Data, Train, Tune), so
#     that it fits the carry limit (Ray's wheel alone is larger).
#   bash tests/gpu/device_wheels.sh [PYTHON_VERSION]   # default 3.12, the image's
set -eu
python_version=${1:-3.12}
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# The device's interpreter and platform, for pip download and pip install --target alike.
target=(--no-deps --only-binary=:all: --python-version "$python_version" --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
download() {  # download DIR NAME...
    local dir=$1
    shift
    local pins=()
    for name in "$@"; do pins+=("$name==$(version "$name")"); done
    python3 -m pip download -q "${target[@]}" -d "$dir" "${pins[@]}"
}
mkdir -p .whl
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >>"$exclude"
download .whl xgrammar apache-tvm-ffi pydantic pydantic_core annotated-types typing-inspection

# The Serve app's packages that the image lacks (it has torch, transformers, aiohttp, grpcio,
# protobuf, requests, httpx, prometheus-client, msgpack, click, filelock, pyyaml; anyio, idna,
# h11 and typing-extensions travel too, at least as new as openai and pydantic need).
serving=(ray fastapi starlette uvicorn annotated-doc openai jiter httpx2 httpcore2 truststore
    anyio idna h11 typing-extensions sniffio
    opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
    jsonschema jsonschema-specifications referencing rpds-py)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download "$work/wheels" "${serving[@]}"
cp .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl "$work/wheels/"
python3 -m pip install -q --no-index "${target[@]}" --no-compile --target "$work/site" \
    "$work"/wheels/*.whl
(cd "$work/site/ray" && rm -rf jars dashboard/client rllib data train tune air/examples \
    llm)
tar -C "$work/site" -cf - . | xz -T0 -6 >.whl/serving-site.tar.xz
rm -f .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl
ls -la .whl
