"""The examples' results pages, rendered at docs-build time from their results.json.

Each example script has `render_markdown(results) -> str`, which it also uses to write its own
results.md; the docs build calls the same function on the committed `docs/results/NAME/results.json`,
so the page can't drift from the file. The committed results.md next to it (what GitHub shows) is
checked to equal that rendering by tests/test_docs_figures.py.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from .figures import DOCS, load

ROOT = DOCS.parent

# page (relative to docs/) -> (results source in figures.SOURCES, example script)
PAGES: dict[str, tuple[str, str]] = {
    "results/depth_scaling/results.md": ("depth_scaling", "examples/depth_scaling.py"),
    "results/warmup_study/results.md": ("warmup_study", "examples/warmup_study.py"),
    "results/warmup_study_lr1e-2/results.md": ("warmup_study_lr1e_2", "examples/warmup_study.py"),
    "results/depth_placements/results.md": ("depth_placements", "examples/warmup_study.py"),
    "results/layernorm_jacobian/results.md": ("layernorm_jacobian", "examples/layernorm_jacobian.py"),
    "results/migrate_post_norm/results.md": ("migrate_post_norm", "examples/migrate_post_norm.py"),
    "results/migrate_trained_screen/results.md": ("migrate_trained_screen", "examples/migrate_trained_screen/summary.py"),
    "results/migrate_suite/results.md": ("migrate_suite", "examples/migrate_suite.py"),
    "results/migrate_drift_positions/results.md": ("migrate_drift_positions", "examples/migrate_suite/drift_positions.py"),
    "results/migrate_why_depth/results.md": ("migrate_why_depth", "examples/migrate_why_depth.py"),
}

# Results pages that are not rendered from their results.json, and why (the page is the script's own output).
NOT_RENDERED: dict[str, str] = {
    "results/migrate_trained/results.md": (
        "examples/migrate_trained.py builds its report from every run's curves (its runs/ folder), which results.json "
        "does not hold in full; the committed results.md is the script's own output (`--report-only` rebuilds it from runs/)."
    ),
    "results/migrate_trained_plugin/results.md": "the same script's own output, for the plugin's arms.",
}


@lru_cache(maxsize=None)
def example_module(script: str) -> ModuleType:
    """Import an example script as a module (its `main()` does not run)."""
    path = ROOT / script
    name = f"_docs_example_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def render(page: str) -> str:
    source, script = PAGES[page]
    return example_module(script).render_markdown(load(source))


def committed(page: str) -> Path:
    return DOCS / page
