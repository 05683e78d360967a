"""Native kernels are rebuilt when their source or a header they include changes."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from engine.cpu.build import _FLAGS, _build


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_editing_an_included_header_rebuilds_the_library(tmp_path):
    header = tmp_path / "answer.h"
    source = tmp_path / "kernel.c"
    source.write_text('#include "answer.h"\nint answer(void) { return ANSWER; }\n')
    header.write_text("#define ANSWER 41\n")
    first = _build(source, _FLAGS)
    assert ctypes.CDLL(str(first)).answer() == 41
    assert _build(source, _FLAGS) == first  # unchanged: the cached build is reused
    header.write_text("#define ANSWER 42\n")
    second = _build(source, _FLAGS)
    assert second != first
    assert ctypes.CDLL(str(second)).answer() == 42


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_a_build_for_another_cpu_is_not_reused(tmp_path, monkeypatch):
    """`-march=native` builds for this CPU: a checkout shared with (or carried to) a host of
    another CPU must build its own library, not load one that may use missing instructions."""
    import engine.cpu.build as native_build

    source = tmp_path / "kernel.c"
    source.write_text("int one(void) { return 1; }\n")
    here = _build(source, _FLAGS)
    if Path("/proc/cpuinfo").is_file():  # Linux: the key holds the CPU's feature flags
        assert b"flags" in native_build._host_cpu()
    monkeypatch.setattr(native_build, "_host_cpu", lambda: b"vendor_id: OtherVendor\nflags: sse2")
    elsewhere = _build(source, _FLAGS)
    assert elsewhere != here
    assert ctypes.CDLL(str(elsewhere)).one() == 1
