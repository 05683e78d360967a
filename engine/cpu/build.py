"""Build a C source into a shared library on first use and load it with ctypes.

No torch headers and no build step at install time: a plain C file becomes a shared library
in `build/native/` (keyed by the source's hash and the host CPU) in about a second.
`load_native(path)` returns None where no compiler is available or
`DYNABATCH_NATIVE_KERNELS=0`; every caller then keeps its pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "native"
# Headers shared by several kernels (`#include "name.h"`).
INCLUDE_DIR = Path(__file__).resolve().parent / "csrc"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_FLAGS += [f"-I{INCLUDE_DIR}"]
_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _source_with_headers(source_path: Path) -> bytes:
    """The source and the local headers it includes (one level): what the build depends on,
    so that editing a shared header rebuilds every kernel that uses it."""
    source = source_path.read_bytes()
    parts = [source]
    for name in _LOCAL_INCLUDE.findall(source):
        for folder in (source_path.parent, INCLUDE_DIR):
            header = folder / name.decode()
            if header.is_file():
                parts.append(header.read_bytes())
                break
    return b"\0".join(parts)


@functools.cache
def _host_cpu() -> bytes:
    """What `-march=native` compiles for: the CPU's model and feature flags. A checkout on a
    filesystem shared by hosts of different CPUs (or carried to another machine) must not
    load a library built for instructions this CPU lacks."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine().encode() + platform.processor().encode()
    keep = ("vendor_id", "cpu family", "model", "flags")
    lines = [line for line in text.splitlines() if line.split(":")[0].strip() in keep]
    return "\n".join(dict.fromkeys(lines)).encode()  # each distinct line once, in order


def _cpuinfo_field(name: str) -> str:
    for line in _host_cpu().decode(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def host_cpu_vendor() -> str:
    """`AuthenticAMD`, `GenuineIntel`, ... from /proc/cpuinfo; "" where it cannot be read."""
    return _cpuinfo_field("vendor_id")


def host_cpu_flags() -> set[str]:
    """The CPU's feature flags (`avx2`, `avx512f`, ...) from /proc/cpuinfo; empty where it
    cannot be read."""
    return set(_cpuinfo_field("flags").split())


_loaded: dict[tuple[Path, tuple[str, ...]], ctypes.CDLL | None] = {}


def _build(source_path: Path, flags: list[str]) -> Path:
    source = _source_with_headers(source_path)
    digest = hashlib.sha256(source + " ".join(flags).encode() + _host_cpu()).hexdigest()[:16]
    target = BUILD_DIR / f"{source_path.stem}-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=BUILD_DIR, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        subprocess.run(
            [compiler, *flags, str(source_path), "-o", str(tmp_path), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        tmp_path.replace(target)  # atomic: concurrent builders never see a half-written file
    finally:
        tmp_path.unlink(missing_ok=True)
    return target


def load_native(source_path: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library of `source_path` (built once per process and source), or None.
    `extra_flags` come after the defaults, so they can override them."""
    key = (source_path, extra_flags)
    if key in _loaded:
        return _loaded[key]
    lib = None
    if os.environ.get("DYNABATCH_NATIVE_KERNELS", "1") != "0":
        try:
            lib = ctypes.CDLL(str(_build(source_path, [*_FLAGS, *extra_flags])))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            logger.warning("native kernels %s unavailable (%s); using torch", source_path.name, exc)
    _loaded[key] = lib
    return lib
