"""Packaging: declared dependencies, one version, the public API's static view, shipped files, and a
fresh virtual environment with only the README's main-job install running the demo, `inspect` and every
monitor.

The fresh-venv test (slow, about 2-4 minutes on 2 cores) runs exactly the README's main-job install,
`pip install torch==2.13.0 && pip install -e .`, in a new `python -m venv` (no system site packages),
then `ln-lightning inspect`, `ln-lightning demo`, and a short `ln-lightning fit` of the demo config with
all three monitors logging on every other step, and imports every module of the package there.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import sys
import zipfile
from pathlib import Path

import pytest

import ln_lightning
from _helpers_venv import clean_env as _clean_env, run as _run

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ln_lightning"
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

# Import name -> the distribution that provides it.
DISTRIBUTIONS = {"PIL": "pillow", "yaml": "pyyaml", "pytorch_lightning": "pytorch-lightning"}
# Modules allowed to import an optional dependency (the extra that provides it, named in its error).
OPTIONAL_IMPORTS = {"triton": {"ln_lightning/norm/_triton_ops.py", "ln_lightning/norm/_triton_rms.py"},
                    "pytorch_lightning": {"ln_lightning/pytorch_lightning.py"}}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _requirement_name(req: str) -> str:
    return re.split(r"[\[<>=!~;\s]", req, maxsplit=1)[0].lower().replace("_", "-")


def _third_party_imports() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top != "ln_lightning":
                    found.setdefault(top, set()).add(rel)
    return found


def test_every_import_is_declared():
    project = _pyproject()["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    for top, users in sorted(_third_party_imports().items()):
        dist = DISTRIBUTIONS.get(top, top).lower()
        if dist in core:
            continue
        providing = sorted(name for name, reqs in extras.items() if dist in reqs and name != "dev")
        assert providing, f"{top} is imported by {sorted(users)} but is not a dependency nor in an extra"
        allowed = OPTIONAL_IMPORTS.get(top, set())
        assert users <= allowed, f"{top} (extra {providing}) is imported outside the modules that handle its absence: {sorted(users - allowed)}"


def test_torchmetrics_is_used_where_declared():
    assert "torchmetrics" in _third_party_imports(), "torchmetrics is declared: the demo's validation metrics use it"


def test_one_version():
    pyproject = _pyproject()
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ln_lightning.__version__"}
    hits = [p for p in PACKAGE.rglob("*.py") if re.search(r"^__version__\s*=", p.read_text(encoding="utf-8"), re.M)]
    assert [p.relative_to(ROOT).as_posix() for p in hits] == ["ln_lightning/__init__.py"]
    from importlib import metadata

    try:
        installed = metadata.version("ln-lightning")
    except metadata.PackageNotFoundError:
        pytest.skip("ln-lightning is not installed in this environment (only on sys.path)")
    assert installed == ln_lightning.__version__


def test_public_api_is_static():
    """`__all__` is a literal equal to the lazy names, and each lazy name is imported under TYPE_CHECKING."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    literal_all = exports = None
    type_checking: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "__all__":
                literal_all = ast.literal_eval(node.value)
            elif node.targets[0].id == "_EXPORTS":
                exports = ast.literal_eval(node.value)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    type_checking[alias.asname or alias.name] = imp.module
    assert literal_all is not None and exports is not None
    assert sorted(literal_all) == sorted([*exports, "__version__"])
    assert type_checking == exports
    assert ln_lightning.__all__ == literal_all and sorted(dir(ln_lightning)) == sorted(literal_all)


def test_every_public_name_resolves():
    for name in ln_lightning.__all__:
        obj = getattr(ln_lightning, name)
        if name != "__version__":
            module = ln_lightning._EXPORTS[name]
            assert obj is getattr(importlib.import_module(module), name)


def test_shipped_files():
    assert (PACKAGE / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["ln_lightning"]
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text and "APPENDIX" in license_text
    assert _pyproject()["project"]["license"] == "Apache-2.0"
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in changelog and f"## [{ln_lightning.__version__}]" in changelog


@pytest.mark.slow
def test_wheel_contents(tmp_path):
    """The built wheel ships py.typed, the CPU kernels' source and the LICENSE, with the declared metadata."""
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)], tmp_path, _clean_env(), 600)
    (wheel,) = tmp_path.glob("ln_lightning-*.whl")
    assert wheel.name.startswith(f"ln_lightning-{ln_lightning.__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "ln_lightning/py.typed" in names
    assert "ln_lightning/norm/csrc/add_norm_cpu.cpp" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert f"Version: {ln_lightning.__version__}\n" in metadata and "License-Expression: Apache-2.0" in metadata
    requires = {_requirement_name(line.split(":", 1)[1].strip()) for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert {"torch", "lightning", "torchmetrics", "tensorboard", "numpy", "pillow", "jsonargparse", "ninja"} <= requires


def _short_demo_config(dest: Path) -> Path:
    """The demo config, shortened: 6 steps, validation at steps 3 and 6, every monitor logging every 2 steps."""
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "demo_migrate_prenorm.yaml").read_text(encoding="utf-8"))
    trainer = cfg["trainer"]
    trainer.update(max_steps=6, val_check_interval=3, limit_val_batches=2, log_every_n_steps=1)
    monitors = [cb for cb in trainer["callbacks"] if cb["class_path"].startswith("ln_lightning.callbacks.")]
    assert len(monitors) == 3
    for cb in monitors:
        cb["init_args"]["every_n_steps"] = 2
    cfg["data"]["init_args"]["max_chars"] = 60000
    path = dest / "demo_short.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.slow
def test_fresh_venv_runs_the_main_job(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, _clean_env(), 300)
    env = _clean_env(venv)
    py = str(venv / "bin" / "python")
    # The README's main-job install, verbatim apart from pip's -q.
    _run(["bash", "-c", "pip install -q torch==2.13.0 && pip install -q -e ."], ROOT, env, 1500)

    # Only the README's install is there: no test or optional packages leaked in.
    r = _run([py, "-c", "import importlib.util as u; print([m for m in ('pytest', 'matplotlib', 'transformers', 'triton', 'mkdocs') if u.find_spec(m)])"], tmp_path, env, 120)
    assert r.stdout.strip() == "[]", r.stdout

    # Every module of the package imports (no undeclared dependency), except the Triton backends (the triton extra)
    # and the pytorch_lightning namespace (the pytorch-lightning extra).
    code = (
        "import importlib, pkgutil, ln_lightning\n"
        "skip = {'ln_lightning.norm._triton_ops', 'ln_lightning.norm._triton_rms', 'ln_lightning.pytorch_lightning'}  # extras: triton, pytorch-lightning\n"
        "mods = [m.name for m in pkgutil.walk_packages(ln_lightning.__path__, 'ln_lightning.') if m.name not in skip]\n"
        "[importlib.import_module(m) for m in mods]\n"
        "[getattr(ln_lightning, n) for n in ln_lightning.__all__]\n"
        "print(len(mods), ln_lightning.__file__)\n"
    )
    r = _run([py, "-c", code], tmp_path, env, 300)
    n_modules, location = r.stdout.split()
    assert int(n_modules) >= 30 and Path(location).resolve() == (PACKAGE / "__init__.py").resolve()

    # `ln-lightning inspect MODULE:FACTORY` as the README shows it, on a user's module in the working directory.
    (tmp_path / "mymodels.py").write_text(
        "from ln_lightning.demo import PostNormTransformerLM\n\n"
        "def build_model():\n    return PostNormTransformerLM(n_layers=3)\n",
        encoding="utf-8",
    )
    r = _run([str(venv / "bin" / "ln-lightning"), "inspect", "mymodels:build_model", "--placement", "pre"], tmp_path, env, 300)
    assert "What convert would change" in r.stdout, r.stdout
    r = _run([str(venv / "bin" / "ln-lightning"), "inspect", "mymodels:build_model", "--json"], tmp_path, env, 300)
    assert "inspect" in json.loads(r.stdout)
    r = _run([str(venv / "bin" / "ln-lightning"), "demo"], tmp_path, env, 300)
    assert "pre" in r.stdout

    config = _short_demo_config(tmp_path)
    r = _run([str(venv / "bin" / "ln-lightning"), "fit", "--config", str(config)], tmp_path, env, 900)
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in r.stdout + r.stderr
    (run_dir,) = (tmp_path / "lightning_logs" / "demo_migrate_prenorm").glob("version_*")
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "ln_placement_report.json").is_file()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    scalars, images = events.Tags()["scalars"], events.Tags()["images"]
    for tag in ("train/loss", "val/loss", "val/ppl", "val/acc"):
        assert tag in scalars, (tag, scalars)
    for prefix in ("stream/", "ln/", "clip/"):  # StreamNormMonitor, LayerNormInputMonitor, ClipAttributionMonitor
        assert any(t.startswith(prefix) for t in scalars), (prefix, scalars)
    assert len(images) == 3, images  # one depth-profile image per monitor (Pillow, numpy)
