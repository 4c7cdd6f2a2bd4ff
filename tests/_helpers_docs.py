"""The docs build's own modules (docs/docgen/), imported under the name the mkdocs hook gives them.

docs/ is not a package on the path; this loads `docs/docgen` as the package `docgen` once, so the
tests use exactly the code the build runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def docgen(module: str):
    """`docgen.<module>` (e.g. "figures"), loaded from docs/docgen/."""
    if "docgen" not in sys.modules:
        init = DOCS / "docgen" / "__init__.py"
        spec = importlib.util.spec_from_file_location("docgen", init, submodule_search_locations=[str(init.parent)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["docgen"] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"docgen.{module}")


def docgen_script(name: str):
    """A script of docs/ (e.g. "render_guides"), loaded as a module (its main() does not run), after docgen."""
    docgen("figures")
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
