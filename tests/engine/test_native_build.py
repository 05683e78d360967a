"""Native kernels are rebuilt when their source or a header they include changes."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from engine.native_build import _FLAGS, _build


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
