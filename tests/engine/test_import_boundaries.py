"""engine.core and the simulator stay pure Python: many schedulers can run without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

_REPORT = "loaded = sorted(n for n in ('torch', 'ray', 'transformers') if n in sys.modules)\n"


def heavy_modules_after(imports: str) -> str:
    """Which of torch, ray, transformers a fresh interpreter holds after running `imports`."""
    code = "import sys\n" + imports + _REPORT + "print(','.join(loaded))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_engine_core_imports_neither_torch_nor_ray():
    imports = (
        "import pkgutil, importlib, engine.core as core\n"
        "for m in pkgutil.iter_modules(core.__path__):\n"
        "    importlib.import_module('engine.core.' + m.name)\n"
    )
    assert heavy_modules_after(imports) == ""


def test_simulator_and_policies_import_neither_torch_nor_ray():
    imports = (
        "import cluster.batching, cluster.workload, cluster.simulator\n"
        "import cluster.control, cluster.autoscale, cluster.status\n"
        "import engine.runner.cost_model\n"
    )
    assert heavy_modules_after(imports) == ""


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file names in an import, TYPE_CHECKING blocks included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_model_sampling_and_kernels_sit_below_the_runner():
    """The runner builds on the decoder, the sampler and the kernels; none of them imports
    the runner back (not even for type hints), so there is no import circle to break."""
    root = Path(__file__).resolve().parents[2] / "engine"
    below = ["model", "sampling", "quant", "attention", "cpu", "core"]
    offenders = [
        f"{path.relative_to(root.parent)} imports {name}"
        for package in below
        for path in sorted((root / package).glob("*.py"))
        for name in _imported_modules(path)
        if name.startswith("engine.runner")
    ]
    assert offenders == []
