"""`ln_lightning.LNLightningWarning`: the class, its filters, and every call site using it.

The call-site check scans the package's source (AST) for `warnings.warn(...)`, `warn(...)` imported
from `warnings`, and Lightning's `rank_zero_warn(...)`, and requires each to pass the category
`LNLightningWarning` (`category=` or, for `warnings.warn`, the second positional argument). Calls of the
package's own helper, `warn` imported from `ln_lightning._warnings`, are call sites too and pass by
construction (the helper always uses the category; its own `warnings.warn` is scanned like any other).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ln_lightning
from ln_lightning import LNLightningWarning

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ln_lightning"
CATEGORY = "LNLightningWarning"


def _warn_calls(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    """Every warning call in `tree`, with the form it takes ("warnings.warn" or "rank_zero_warn")."""
    warn_names = {"rank_zero_warn": "rank_zero_warn"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "warnings":
            for alias in node.names:
                if alias.name == "warn":
                    warn_names[alias.asname or "warn"] = "warnings.warn"
        if isinstance(node, ast.ImportFrom) and node.module == "ln_lightning._warnings":
            for alias in node.names:
                if alias.name == "warn":
                    warn_names[alias.asname or "warn"] = "helper"
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "warn" and isinstance(func.value, ast.Name) and func.value.id == "warnings":
            calls.append((node, "warnings.warn"))
        elif isinstance(func, ast.Attribute) and func.attr == "rank_zero_warn":
            calls.append((node, "rank_zero_warn"))
        elif isinstance(func, ast.Name) and func.id in warn_names:
            calls.append((node, warn_names[func.id]))
    return calls


def _is_category(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Name):
        return node.id == CATEGORY
    if isinstance(node, ast.Attribute):
        return node.attr == CATEGORY
    return False


def _passes_category(call: ast.Call, form: str) -> bool:
    if form == "helper":
        return True  # ln_lightning._warnings.warn always warns with LNLightningWarning
    for kw in call.keywords:
        if kw.arg == "category":
            return _is_category(kw.value)
    # warnings.warn(message, category, stacklevel); rank_zero_warn(message, stacklevel, **kwargs)
    return form == "warnings.warn" and len(call.args) >= 2 and _is_category(call.args[1])


def scan(root: Path = PACKAGE, base: Path = ROOT) -> tuple[list[str], list[str]]:
    """(all warning call sites under `root`, those not passing LNLightningWarning), as `path:line` relative to `base`."""
    sites, offenders = [], []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for call, form in sorted(_warn_calls(tree), key=lambda cf: cf[0].lineno):
            where = f"{path.relative_to(base).as_posix()}:{call.lineno}"
            sites.append(where)
            if not _passes_category(call, form):
                offenders.append(where)
    return sites, offenders


def test_the_class():
    assert issubclass(LNLightningWarning, UserWarning)
    assert ln_lightning.LNLightningWarning is LNLightningWarning
    assert "LNLightningWarning" in ln_lightning.__all__
    with pytest.warns(LNLightningWarning, match="x"):
        warnings.warn("x", LNLightningWarning)


def test_helper_names_the_first_frame_outside_the_package():
    from ln_lightning import _warnings

    with pytest.warns(LNLightningWarning, match="direct") as rec:
        _warnings.warn("direct")  # called from user code: this line
    assert rec[0].filename == __file__  # (from inside a Lightning hook: the subprocess test below)


def _run(code: str, *python_args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *python_args, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow
def test_importable_without_lightning_or_torch():
    r = _run("import sys; from ln_lightning import LNLightningWarning; "
             "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.slow
def test_command_line_filter_turns_it_into_an_error():
    code = "import warnings, ln_lightning; warnings.warn('from the package', ln_lightning.LNLightningWarning)"
    r = _run(code, "-W", "error::ln_lightning.LNLightningWarning")
    assert r.returncode != 0 and "LNLightningWarning: from the package" in r.stderr, r.stderr
    assert "Invalid -W option" not in r.stderr
    r = _run(code.replace("LNLightningWarning)", "LNLightningWarning); warnings.warn('other', UserWarning)"),
             "-W", "error::ln_lightning.LNLightningWarning", "-W", "ignore::UserWarning")
    assert r.returncode == 0, r.stderr  # a later, more general filter wins: the category is a UserWarning


def test_scanner_sees_each_form(tmp_path):
    src = tmp_path / "ln_lightning"
    src.mkdir()
    (src / "m.py").write_text(
        "import warnings\n"
        "from warnings import warn as w\n"
        "from lightning.pytorch.utilities.rank_zero import rank_zero_warn\n"
        "from ln_lightning import LNLightningWarning\n"
        "warnings.warn('a')\n"                                          # 5: offender
        "warnings.warn('b', LNLightningWarning, stacklevel=2)\n"        # 6: ok
        "w('c', category=UserWarning)\n"                                # 7: offender
        "rank_zero_warn('d', stacklevel=3)\n"                           # 8: offender
        "rank_zero_warn('e', category=LNLightningWarning)\n"            # 9: ok
        "rank_zero_warn('f', 2, category=ln_lightning.LNLightningWarning)\n"  # 10: ok
        "x = 'warnings.warn(\"in a string\")'\n"
    )
    (src / "h.py").write_text("from ln_lightning._warnings import warn\nwarn('g')\n")  # the helper: ok
    sites, offenders = scan(src, tmp_path)
    assert sites == ["ln_lightning/h.py:2"] + [f"ln_lightning/m.py:{n}" for n in (5, 6, 7, 8, 9, 10)]
    assert offenders == ["ln_lightning/m.py:5", "ln_lightning/m.py:7", "ln_lightning/m.py:8"]


def test_the_package_has_warning_call_sites():
    sites, _ = scan()
    assert len(sites) >= 10, sites  # the scan is not vacuous


def test_every_warning_call_passes_the_category():
    _, offenders = scan()
    assert not offenders, "warning calls without category=LNLightningWarning:\n" + "\n".join(offenders)


_FIT_WITHOUT_NORMS = '''
import sys, warnings
import torch
from torch.utils.data import DataLoader, TensorDataset
if sys.argv[1] == "pytorch_lightning":
    import pytorch_lightning as pl
    from ln_lightning.pytorch_lightning import LayerNormInputMonitor, StreamNormMonitor
else:
    import lightning.pytorch as pl
    from ln_lightning import LayerNormInputMonitor, StreamNormMonitor

class NoNorms(pl.LightningModule):  # nothing for the monitors to watch: each warns at setup
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = pl.Trainer(max_steps=1, logger=pl.loggers.CSVLogger("."), enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[LayerNormInputMonitor(), StreamNormMonitor()])
with warnings.catch_warnings(record=True) as caught:
    if not sys.warnoptions:  # keep a -W error::... given on the command line
        warnings.simplefilter("always")
    trainer.fit(NoNorms(), DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2))  # FIT LINE
for w in caught:
    if w.category.__name__ == "LNLightningWarning":
        print("WARNED", w.filename, w.lineno, str(w.message)[:40])
'''


@pytest.mark.slow
@pytest.mark.parametrize("ns", ["lightning.pytorch", "pytorch_lightning"])
def test_command_line_error_filter_stops_the_packages_warnings_at_the_users_line(ns, tmp_path):
    if ns == "pytorch_lightning":
        pytest.importorskip("pytorch_lightning")
    script = tmp_path / "user_script.py"
    script.write_text(_FIT_WITHOUT_NORMS)
    fit_line = next(i for i, line in enumerate(_FIT_WITHOUT_NORMS.splitlines(), 1) if "# FIT LINE" in line)

    def run(*python_args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        return subprocess.run([sys.executable, *python_args, str(script), ns], capture_output=True, text=True, env=env,
                              timeout=300, cwd=tmp_path)

    # Without the filter: the warnings are LNLightningWarnings and name the user's fit line, not a library frame.
    r = run()
    assert r.returncode == 0, r.stderr
    warned = [line.split() for line in r.stdout.splitlines() if line.startswith("WARNED")]
    assert len(warned) >= 2, r.stdout + r.stderr
    assert all(w[1] == str(script) and int(w[2]) == fit_line for w in warned), warned
    # With it: the first package warning is an error.
    r = run("-W", "error::ln_lightning.LNLightningWarning")
    assert r.returncode != 0
    assert "ln_lightning.LNLightningWarning: LayerNormInputMonitor found no LayerNorm modules" in r.stderr, r.stderr[-3000:]
