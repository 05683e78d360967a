"""A step's figures, written to its JSON file after each part, so that a step stopped at its
timeout still leaves what it measured; a part that fails records why and the step goes on."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Findings:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.figures: dict[str, Any] = {}
        self.errors: dict[str, str] = {}

    def record(self, **figures: Any) -> None:
        self.figures.update(figures)
        self._write()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Runs the block; an exception in it is recorded under `name`, not raised."""
        try:
            yield
        except Exception as exc:
            traceback.print_exc()
            self.errors[name] = f"{type(exc).__name__}: {exc}"[:500]
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"figures": self.figures, "errors": self.errors}, indent=1))
        os.replace(tmp, self.path)  # a reader never sees half a file
