"""engine.core and the simulator stay pure Python: many schedulers can run without torch."""

from __future__ import annotations

import subprocess
import sys

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
