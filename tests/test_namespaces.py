"""Everything a user puts in a Trainer, with `pytorch_lightning.Trainer` as with `lightning.pytorch.Trainer`.

`from ln_lightning import ...` serves `lightning.pytorch`, `from ln_lightning.pytorch_lightning import ...`
serves `pytorch_lightning` (ln_lightning/pytorch_lightning.py). Each test runs on both namespaces; mixing
them is refused with an error naming both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Reported in the -ra summary; the dev extra (CI) installs it.
pytest.importorskip("pytorch_lightning", reason="the pytorch_lightning namespace needs `pip install pytorch-lightning`")

from _helpers_namespaces import NAMESPACES, loader, namespace  # noqa: E402
from ln_lightning.testing.monitors import read_scalars  # noqa: E402
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _trainer(ns, tmp_path, **kw):
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    return ns.pl.Trainer(default_root_dir=str(tmp_path), accelerator="cpu", devices=kw.pop("devices", 1), max_steps=kw.pop("max_steps", 2),
                         enable_progress_bar=False, enable_model_summary=False, **kw)


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _print_version(ns):  # which Lightning each run used, in the -rA/-v output and CI logs
    print(f"{ns.name} {ns.pl.__version__}")


@pytest.fixture(params=NAMESPACES)
def ns(request):
    ns = namespace(request.param)
    _print_version(ns)
    return ns


def test_objects_are_the_namespaces_own_classes(ns):
    other = namespace(ns.other)
    placement = ns.ln.LNPlacement()
    monitors = [ns.ln.StreamNormMonitor(), ns.ln.LayerNormInputMonitor(), ns.ln.ClipAttributionMonitor()]
    assert isinstance(placement, ns.pl.plugins.LayerSync) and isinstance(placement, ns.pl.Callback)
    assert not isinstance(placement, other.pl.plugins.LayerSync) and not isinstance(placement, other.pl.Callback)
    for m in monitors:
        assert isinstance(m, ns.pl.Callback) and not isinstance(m, other.pl.Callback)
    # the Lightning-free parts are shared: one warning class, one engine
    assert ns.ln.LNPlacement is not other.ln.LNPlacement
    import ln_lightning
    from ln_lightning import pytorch_lightning as lnpl

    assert sys.modules[type(lnpl.LNPlacement()).__module__].PlacementError is ln_lightning.PlacementError


@pytest.mark.parametrize("form", ["plugin", "callback"])
def test_plugin_and_callback_form_rewrite_one_cpu_process(ns, form, tmp_path):
    model = ns.Model()
    placement = ns.ln.LNPlacement("pre", fused=False, log_report=False)
    kw = {"plugins": [placement]} if form == "plugin" else {"callbacks": [placement]}
    trainer = _trainer(ns, tmp_path, **kw)
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"
    trainer.fit(model, loader())
    assert trainer.global_step == 2
    assert ns.ln.LNPlacement.applied_config(model)["placement"] == "pre"
    assert placement.report is not None and len(placement.report.converted) == 2


def test_checkpoint_round_trip(ns, tmp_path):
    model = ns.Model()
    ckpt = ns.pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    trainer = _trainer(ns, tmp_path, plugins=[ns.ln.LNPlacement(fused=False, log_report=False)], callbacks=[ckpt],
                       enable_checkpointing=True)
    trainer.fit(model, loader())
    path = ckpt.last_model_path
    assert path
    loaded = ns.ln.load_converted(ns.Model, path)
    assert type(loaded) is ns.Model and ns.ln.LNPlacement.applied_config(loaded) == ns.ln.LNPlacement.applied_config(model)
    x = torch.randint(0, 32, (2, 8))
    model.eval()
    torch.testing.assert_close(loaded(x), model(x))
    # and back into a Trainer: validate-free resume of the same run from the checkpoint
    resumed = _trainer(ns, tmp_path, max_steps=3, plugins=[ns.ln.LNPlacement(fused=False, log_report=False)])
    resumed.fit(ns.Model(), loader(), ckpt_path=path)
    assert resumed.global_step == 3


def test_three_monitors_log_to_tensorboard(ns, tmp_path):
    logger = ns.pl.loggers.TensorBoardLogger(str(tmp_path), name="tb")
    monitors = [ns.ln.StreamNormMonitor(every_n_steps=1), ns.ln.LayerNormInputMonitor(every_n_steps=1),
                ns.ln.ClipAttributionMonitor(every_n_steps=1)]
    trainer = _trainer(ns, tmp_path, logger=logger, callbacks=monitors, max_steps=2, gradient_clip_val=1.0)
    trainer.fit(ns.Model(), loader())
    logger.experiment.flush()
    tags = read_scalars(logger.log_dir)
    for prefix in ("stream/", "ln/", "clip/"):
        logged = [t for t in tags if t.startswith(prefix)]
        assert logged, f"no {prefix} scalars in {sorted(tags)}"
        assert {step for t in logged for step, _ in tags[t]} == {0, 1}, {t: tags[t] for t in logged}  # every_n_steps=1


@pytest.mark.slow
@pytest.mark.parametrize("form", ["plugin", "callback"])
def test_plugin_and_callback_form_on_ddp_spawn_two_processes(ns, form, tmp_path):
    model = ns.Model()
    placement = ns.ln.LNPlacement("pre", fused=False, log_report=False)
    kw = {"plugins": [placement], "callbacks": [ns.DestroyPG()]} if form == "plugin" else {"callbacks": [placement, ns.DestroyPG()]}
    trainer = _trainer(ns, tmp_path, strategy="ddp_spawn", devices=2, **kw)
    trainer.fit(model, loader())
    assert trainer.world_size == 2
    # the main process holds rank 0's trained weights in the rewritten architecture (none dropped)
    assert ns.ln.LNPlacement.applied_config(model)["placement"] == "pre"
    fresh = ns.Model()
    ns.ln.LNPlacement("pre", fused=False, log_report=False).rewrite(fresh)
    assert set(fresh.state_dict()) == set(model.state_dict())
    assert any(not torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("make", ["LNPlacement", "StreamNormMonitor", "LayerNormInputMonitor", "ClipAttributionMonitor"])
def test_mixing_namespaces_in_one_trainer_names_both(ns, make, tmp_path):
    other = namespace(ns.other)
    obj = getattr(other.ln, make)()
    if _minor(ns.pl.__version__) < (2, 6):
        # Lightning 2.5 checks the callbacks' classes in Trainer(...), before any ln_lightning code runs, and
        # refuses a foreign one with its own (terse) error; 2.6 dropped that check and ln_lightning's names both.
        with pytest.raises(ValueError, match="Expected a parent"):
            _trainer(ns, tmp_path, callbacks=[obj])
        return
    trainer = _trainer(ns, tmp_path, callbacks=[obj])
    with pytest.raises(TypeError, match=rf"{make} was imported for {other.name}.*this Trainer is a {ns.name}\.Trainer.*"
                                        rf"can't be mixed.*Use `from {'ln_lightning.pytorch_lightning' if ns.name == 'pytorch_lightning' else 'ln_lightning'} import {make}`"):
        trainer.fit(ns.Model(), loader())


def test_other_namespaces_plugin_is_refused_by_the_trainer(ns, tmp_path):
    # As a plugin, the foreign LNPlacement never reaches ln_lightning: Lightning's own type check refuses it
    # at Trainer(...), printing the object, whose repr names both namespaces and the import to use.
    other = namespace(ns.other)
    source = "ln_lightning.pytorch_lightning" if ns.name == "pytorch_lightning" else "ln_lightning"
    with pytest.raises(Exception, match=rf"Found invalid type for plugin LNPlacement.*built for {ns.other} Trainers; "
                                        rf"a {ns.name} Trainer needs `from {source} import LNPlacement`"):
        _trainer(ns, tmp_path, plugins=[other.ln.LNPlacement()])


# Modules that import Lightning but are not things a user puts in a Trainer (lightning.pytorch only).
_LIGHTNING_ONLY = {"ln_lightning/demo/lightning.py", "ln_lightning/lightning_cli.py", "ln_lightning/pytorch_lightning.py"}


def test_every_module_that_imports_lightning_is_translated_for_pytorch_lightning():
    # A new Lightning-facing module (a callback, a plugin piece) must be added to `_CLONED` in
    # ln_lightning/pytorch_lightning.py, or pytorch_lightning users would get lightning.pytorch classes from it.
    import ast

    from ln_lightning import pytorch_lightning as lnpl

    root = Path(__file__).resolve().parents[1]
    importing = set()
    for path in (root / "ln_lightning").rglob("*.py"):
        if (root / "ln_lightning" / "testing") in path.parents:
            continue  # the test suite's own helpers (lightning.pytorch only), not part of the user-facing API
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            if any(n == "lightning" or n.startswith("lightning.") for n in names):
                importing.add(path.relative_to(root).as_posix())
    cloned = {"ln_lightning/" + m.replace(".", "/") + ("/__init__.py" if m == "callbacks" else ".py") for m in lnpl._CLONED}
    assert importing - _LIGHTNING_ONLY <= cloned, sorted(importing - _LIGHTNING_ONLY - cloned)
