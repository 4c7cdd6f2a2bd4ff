"""An example script's module, imported from its file (examples/ is not a package and not on `sys.path`).

A user runs `python examples/NAME.py`, which puts examples/ first on the path; a test imports the same file by
its location instead, so no test edits `sys.path` or depends on a PYTHONPATH a user does not have.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    """`examples/<name>.py` as the module `name` (registered in `sys.modules`, so its classes pickle)."""
    if name in sys.modules:
        return sys.modules[name]
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the example {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
