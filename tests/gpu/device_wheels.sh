#!/usr/bin/env bash
# Wheels of the project's dependencies that the GPU machine's image lacks (xgrammar and what
# it needs), at the versions of this checkout's .venv, into .whl/ (git-ignored): name `.whl`
# in the device tool's `carry`, and tests/gpu/on_device.sh installs them there.
#   bash tests/gpu/device_wheels.sh
set -eu
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >>"$exclude"
names=(xgrammar apache-tvm-ffi pydantic pydantic_core annotated-types typing-inspection)
pins=()
for name in "${names[@]}"; do pins+=("$name==$(version "$name")"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
ls .whl
