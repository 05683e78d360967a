"""engine.core stays pure Python so the simulator can run many schedulers without torch."""

from __future__ import annotations

import subprocess
import sys


def test_engine_core_imports_neither_torch_nor_ray():
    code = (
        "import pkgutil, importlib, sys, engine.core as core\n"
        "for m in pkgutil.iter_modules(core.__path__):\n"
        "    importlib.import_module('engine.core.' + m.name)\n"
        "loaded = sorted(n for n in ('torch', 'ray', 'transformers') if n in sys.modules)\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_simulator_and_policies_import_neither_torch_nor_ray():
    code = (
        "import sys, cluster.batching, cluster.workload, cluster.simulator\n"
        "import engine.runner.cost_model\n"
        "loaded = sorted(n for n in ('torch', 'ray', 'transformers') if n in sys.modules)\n"
        "print(','.join(loaded))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
