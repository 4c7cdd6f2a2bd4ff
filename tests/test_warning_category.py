"""`ln_lightning.LNLightningWarning`: the class, its filters, and every call site using it.

The filters are checked as a user meets them: in a venv with the package installed from its wheel (not
editable), run from a temporary directory, with no `PYTHONPATH` (tests/_helpers_venv.py). The documented
ones (`DOCUMENTED_FILTERS`, each quoted verbatim from the troubleshooting guide) must turn the package's real warnings into
errors there; the interpreter's own `-W` must be what the guide says it is: ignored ("Invalid -W option
ignored"), because CPython resolves `-W` categories before site-packages is importable.

The call-site check scans the package's source (AST) for `warnings.warn(...)`, `warn(...)` imported
from `warnings`, and Lightning's `rank_zero_warn(...)`, and requires each to pass the category
`LNLightningWarning` (`category=` or, for `warnings.warn`, the second positional argument). Calls of the
package's own helper, `warn` imported from `ln_lightning._warnings`, are call sites too and pass by
construction (the helper always uses the category; its own `warnings.warn` is scanned like any other).
"""

from __future__ import annotations

import ast
import functools
import json
import re
import warnings
from pathlib import Path

import pytest

import ln_lightning
from _helpers_venv import InstalledVenv, installed_wheel_venv
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


# LNLightningDeprecationWarning subclasses LNLightningWarning (test_the_deprecation_category_is_the_package_s)
CATEGORIES = {CATEGORY, "LNLightningDeprecationWarning"}


def _is_category(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Name):
        return node.id in CATEGORIES
    if isinstance(node, ast.Attribute):
        return node.attr in CATEGORIES
    return False


def _passes_category(call: ast.Call, form: str) -> bool:
    if form == "helper":
        return True  # ln_lightning._warnings.warn always warns with LNLightningWarning
    for kw in call.keywords:
        if kw.arg == "category":
            return _is_category(kw.value)
    # warnings.warn(message, category, stacklevel); rank_zero_warn(message, stacklevel, **kwargs)
    return form == "warnings.warn" and len(call.args) >= 2 and _is_category(call.args[1])


@functools.lru_cache(maxsize=4)  # two tests scan the package as it is: once per run is enough
def _scan_package() -> tuple[tuple[str, ...], tuple[str, ...]]:
    sites, offenders = _scan(PACKAGE, ROOT)
    return tuple(sites), tuple(offenders)


def scan(root: Path = PACKAGE, base: Path = ROOT) -> tuple[list[str], list[str]]:
    """(all warning call sites under `root`, those not passing LNLightningWarning), as `path:line` relative to `base`."""
    if (root, base) == (PACKAGE, ROOT):
        sites, offenders = _scan_package()
        return list(sites), list(offenders)
    return _scan(root, base)


def _scan(root: Path, base: Path) -> tuple[list[str], list[str]]:
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


def test_the_deprecation_category_is_the_package_s():
    from ln_lightning import LNLightningDeprecationWarning

    assert issubclass(LNLightningDeprecationWarning, LNLightningWarning)
    assert issubclass(LNLightningDeprecationWarning, FutureWarning)  # shown by default, unlike DeprecationWarning


def test_the_package_has_warning_call_sites():
    sites, _ = scan()
    assert len(sites) >= 10, sites  # the scan is not vacuous


def test_every_warning_call_passes_the_category():
    _, offenders = scan()
    assert not offenders, "warning calls without category=LNLightningWarning:\n" + "\n".join(offenders)


# The filters the docs promise (the troubleshooting guide's "Warnings and log messages", ln_lightning/_warnings.py),
# verbatim: the tests below run exactly these strings.
DOCUMENTED_FILTERS = {
    "code": 'warnings.filterwarnings("error", category=LNLightningWarning)',
    "pytest -W": "python -m pytest -W error::ln_lightning.LNLightningWarning",
    "pytest ini": 'filterwarnings = ["error::ln_lightning.LNLightningWarning"]',
}
# What the interpreter's -W says about a category it cannot import yet.
INVALID_W = "Invalid -W option ignored: invalid module name: 'ln_lightning'"
GUIDE = ROOT / "docs" / "guides" / "troubleshooting.md"
DOCS = [GUIDE, PACKAGE / "_warnings.py"]


def test_the_docs_quote_the_tested_filters():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for name in ("code", "pytest -W"):
            assert DOCUMENTED_FILTERS[name] in text, (doc.name, name)
    guide = GUIDE.read_text(encoding="utf-8")
    assert DOCUMENTED_FILTERS["pytest ini"] in guide and INVALID_W in guide


def test_no_doc_promises_the_interpreters_W_option_for_the_category():
    """`python -W ...::ln_lightning...` and `PYTHONWARNINGS=...ln_lightning...` appear only where a doc says
    they do not work; a `-W` naming the category is otherwise pytest's."""
    offenders = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for doc in dict.fromkeys([*DOCS, *pages, ROOT / "CHANGELOG.md", *sorted(PACKAGE.rglob("*.py"))]):
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"(\S*)\s+-W\s*[\"']?\w*::ln_lightning|PYTHONWARNINGS=\S*ln_lightning", text):
            before = m.group(1) or ""
            if before.endswith("pytest"):
                continue
            sentence = text[max(0, m.start() - 300):m.end() + 300]
            if "not work" not in sentence and "cannot" not in sentence:
                offenders.append(f"{doc.relative_to(ROOT)}: {text[max(0, m.start() - 40):m.end() + 40]!r}")
    assert not offenders, "the interpreter's -W is promised for the category:\n" + "\n".join(offenders)


# --------------------------------------------------------------------------- in an installed venv

@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> InstalledVenv:
    venv = installed_wheel_venv(tmp_path_factory.mktemp("installed"))
    cwd = tmp_path_factory.mktemp("cwd")
    probe = venv.run(["-c", "import json, sys, ln_lightning; print(ln_lightning.__file__); print(json.dumps(sys.path))"],
                     cwd, timeout=120)
    assert probe.returncode == 0, probe.stderr
    location, path = probe.stdout.splitlines()
    assert Path(location).is_relative_to(venv.site_packages), location  # the installed copy, not the source tree
    assert not any((cwd / p).resolve() == ROOT for p in json.loads(path)), path  # "" is the cwd
    return venv


# A user's script: a 1-step fit whose monitors find nothing to watch, so each warns at setup (a real
# package warning, raised inside a Lightning hook and attributed to the user's fit line).
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
from ln_lightning import LNLightningWarning

class NoNorms(pl.LightningModule):  # nothing for the monitors to watch: each warns at setup
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def fit():
    trainer = pl.Trainer(max_steps=1, logger=pl.loggers.CSVLogger("."), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[LayerNormInputMonitor(), StreamNormMonitor()])
    trainer.fit(NoNorms(), DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2))  # FIT LINE

if __name__ == "__main__":
    if sys.argv[2] == "record":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit()
        for w in caught:
            if w.category is LNLightningWarning:
                print("WARNED", w.filename, w.lineno, str(w.message)[:40])
    else:
        FILTER
        fit()
        print("NO ERROR")
'''
_FIT_LINE = next(i for i, line in enumerate(_FIT_WITHOUT_NORMS.splitlines(), 1) if "# FIT LINE" in line)
_FIRST_WARNING = "LNLightningWarning: LayerNormInputMonitor found no LayerNorm modules"


def _user_script(tmp_path: Path) -> Path:
    script = tmp_path / "user_script.py"
    script.write_text(_FIT_WITHOUT_NORMS.replace("FILTER", DOCUMENTED_FILTERS["code"]), encoding="utf-8")
    return script


@pytest.mark.slow
@pytest.mark.parametrize("ns", ["lightning.pytorch", "pytorch_lightning"])
def test_the_warnings_name_the_users_line_and_the_code_filter_makes_them_errors(ns, installed, tmp_path):
    if ns == "pytorch_lightning":
        pytest.importorskip("pytorch_lightning")
    script = _user_script(tmp_path)
    # Without a filter: LNLightningWarnings, naming the user's fit line, not a library frame.
    r = installed.run([str(script), ns, "record"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [line.split() for line in r.stdout.splitlines() if line.startswith("WARNED")]
    assert len(warned) >= 2, r.stdout + r.stderr[-3000:]
    assert all(w[1] == str(script) and int(w[2]) == _FIT_LINE for w in warned), warned
    # With the documented filter in the code: the first package warning is an error, raised from the fit line.
    r = installed.run([str(script), ns, "error"], tmp_path)
    assert r.returncode != 0 and "NO ERROR" not in r.stdout, r.stdout + r.stderr[-3000:]
    assert f"ln_lightning.{_FIRST_WARNING}" in r.stderr, r.stderr[-3000:]
    assert f'File "{script}", line {_FIT_LINE}, in fit' in r.stderr, r.stderr[-3000:]


_USER_TEST = _FIT_WITHOUT_NORMS.split("if __name__")[0] + '''

def test_fit():
    fit()
'''


@pytest.mark.slow
def test_pytests_documented_filters_make_the_warnings_errors(installed, tmp_path):
    # (The user's module reads sys.argv[1] for the namespace: under pytest it is an option, so lightning.pytorch.)
    (tmp_path / "test_user.py").write_text(_USER_TEST, encoding="utf-8")
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"]

    # Control: without a filter the test passes, and pytest reports the package's warning.
    r = installed.run(pytest_args, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 passed" in r.stdout and _FIRST_WARNING in r.stdout, r.stdout[-3000:]

    # pytest's -W, as documented: the warning fails the test.
    cli = DOCUMENTED_FILTERS["pytest -W"].split()
    assert cli[:3] == ["python", "-m", "pytest"]
    r = installed.run([*pytest_args[:2], *cli[3:], *pytest_args[2:]], tmp_path)
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"ln_lightning.{_FIRST_WARNING}" in r.stdout, r.stdout[-3000:]

    # The ini option, as documented, in the user's pyproject.toml.
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n" + DOCUMENTED_FILTERS["pytest ini"] + "\n",
                                             encoding="utf-8")
    r = installed.run(pytest_args, tmp_path)
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"ln_lightning.{_FIRST_WARNING}" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow
def test_the_interpreters_W_option_cannot_name_the_category(installed, tmp_path):
    """What the docs say instead of promising it: the interpreter ignores `-W error::ln_lightning.LNLightningWarning`
    (and the same in PYTHONWARNINGS) for an installed package, and the warning stays a warning."""
    code = "from ln_lightning._warnings import warn; warn('from the package'); print('NO ERROR')"
    for args, extra_env in ((["-W", "error::ln_lightning.LNLightningWarning"], None),
                            ([], {"PYTHONWARNINGS": "error::ln_lightning.LNLightningWarning"})):
        r = installed.run([*args, "-c", code], tmp_path, timeout=120, extra_env=extra_env)
        assert r.returncode == 0 and "NO ERROR" in r.stdout, (args, extra_env, r.stdout, r.stderr)
        assert INVALID_W in r.stderr and "LNLightningWarning: from the package" in r.stderr, r.stderr
    # The interpreter's -W does work for categories it can import at start-up, LNLightningWarning's base among them
    # (and then for every library's UserWarnings).
    r = installed.run(["-W", "error::UserWarning", "-c", code], tmp_path, timeout=120)
    assert r.returncode != 0 and "ln_lightning.LNLightningWarning: from the package" in r.stderr, r.stderr


@pytest.mark.slow
def test_importable_without_lightning_or_torch(installed, tmp_path):
    r = installed.run(["-c", "import sys; from ln_lightning import LNLightningWarning; "
                             "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"], tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
