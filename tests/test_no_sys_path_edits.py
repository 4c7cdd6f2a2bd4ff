"""No test, test helper or study example edits `sys.path`: the suite runs on what a user has (the installed
package, pyproject.toml's `pythonpath = ["tests"]` for the helpers), and examples are imported by file
(`_helpers_examples.load_example`). The one exception is restoring a snapshot (`sys.path[:] = saved`) around
a benchmark script that edits it (tests/test_gpu_scripts.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from _helpers_examples import EXAMPLES, load_example

ROOT = Path(__file__).resolve().parents[1]
_EDIT = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\s*\(|=|\+=)|sys\.path\[[^\]]*\]\s*=(?!\s*\w+\s*(#|$))")


def _edits(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if _EDIT.search(line) and not line.lstrip().startswith("#")]


def test_the_pattern_finds_edits():
    assert _EDIT.search("sys.path.insert(0, str(ROOT))") and _EDIT.search("sys.path.append(x)")
    assert _EDIT.search("sys.path = [x]") and _EDIT.search("sys.path[:0] = [x]")
    assert not _EDIT.search("sys.path[:] = path  # restored") and not _EDIT.search("print(sys.path)")


def test_no_test_or_study_example_edits_sys_path():
    files = [*sorted((ROOT / "tests").glob("*.py")), *sorted(EXAMPLES.glob("migrate_trained*.py")),
             *sorted(EXAMPLES.glob("migrate_trained*/*.py"))]
    offenders = [e for f in files if f.name != Path(__file__).name for e in _edits(f)]
    assert not offenders, "sys.path edits:\n" + "\n".join(offenders)


def test_an_example_loads_by_file_without_examples_on_the_path():
    assert str(EXAMPLES) not in sys.path
    module = load_example("migrate_trained_methods")
    assert Path(module.__file__) == EXAMPLES / "migrate_trained_methods.py"
    assert load_example("migrate_trained_methods") is module
