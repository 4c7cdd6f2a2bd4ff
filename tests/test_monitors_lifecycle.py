"""The monitors leave nothing behind: after a fit that fails anywhere (setup, training_step, a callback, a logging
step, validation) no hook of theirs stays on the model and no gate stays open, and the next fit, with the same
monitor objects on the same model, logs and trains exactly as a fresh model with fresh monitors does.

Lightning calls no `teardown` after an exception, only `Callback.on_exception`.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from ln_lightning.testing.monitors import FixedBatchLM, all_monitors, make_data, read_scalars

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

LOG_EVERY = 2  # logging steps 1, 3, ...
FAIL_AT = 3  # a logging step: the monitors' gates are open when it fails


class Failure(RuntimeError):
    pass


def _monitor_hooks(module: torch.nn.Module) -> list[str]:
    """Where each forward (pre-)hook on `module`'s submodules comes from (the test model has none of its own)."""
    out = []
    for name, m in module.named_modules():
        for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()):
            out.append(f"{name}: {getattr(getattr(hook, '__code__', None), 'co_filename', hook)}")
    return out


def _open_state(monitor) -> dict:
    """Whatever of a monitor's run is still held: open gates, statistics, registered hooks."""
    held = {k: getattr(monitor, k) for k in ("_enabled", "_logging", "_active", "_paused") if getattr(monitor, k, False)}
    if getattr(monitor, "_handles", None):
        held["_handles"] = len(monitor._handles)
    if getattr(monitor, "_stats", None) is not None:
        held["_stats"] = "allocated"
    return held


class FailingLM(FixedBatchLM):
    """Fails in `where` at logging step FAIL_AT (training_step, validation_step) and otherwise trains with lr 0.1."""

    def __init__(self, x, y, where: str | None = None):
        super().__init__(x, y, n_batches=8, lr=0.1)
        self.where = where

    def _at_fail_step(self) -> bool:
        return self.trainer.fit_loop.epoch_loop._batches_that_stepped == FAIL_AT  # Lightning's logging step

    def training_step(self, batch, batch_idx):
        if self.where == "training_step" and self._at_fail_step():
            raise Failure("training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.where == "validation" and self._at_fail_step():
            raise Failure("validation_step")
        return self.model(self.x[0, 0]).sum()

    def val_dataloader(self):
        return torch.utils.data.DataLoader(range(1), batch_size=None)


class FailIn(L.Callback):
    """Raises in `hook` (at step FAIL_AT for batch hooks); put before the monitors so that theirs has not run yet."""

    def __init__(self, hook: str):
        self.hook = hook

    def setup(self, trainer, pl_module, stage):
        if self.hook == "setup":
            raise Failure("setup")

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.hook == "on_train_batch_end" and trainer.global_step == FAIL_AT + 1:  # the step's optimizer has stepped
            raise Failure("on_train_batch_end")


class HeldAtFailure(L.Callback):
    """Put first: records what the monitors held when the exception reached the callbacks (before theirs ran)."""

    def __init__(self, monitors):
        self.monitors, self.held = monitors, None

    def on_exception(self, trainer, pl_module, exception):
        self.held = {type(m).__name__: _open_state(m) for m in self.monitors}


class FailingLogger(TensorBoardLogger):
    """Fails when the first monitor logs its metrics at step FAIL_AT: the other monitors are mid-step."""

    def log_metrics(self, metrics, step=None):
        if step == FAIL_AT and any(k.startswith("stream/") for k in metrics):
            raise Failure("log_metrics")
        super().log_metrics(metrics, step)


def _trainer(out, name, callbacks, logger=None, **kw) -> L.Trainer:
    kw.setdefault("max_steps", 6)
    return L.Trainer(accelerator="cpu", devices=1, log_every_n_steps=LOG_EVERY, callbacks=callbacks,
                     logger=logger or TensorBoardLogger(str(out), name=name, version=0), num_sanity_val_steps=0,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)


FAILURES = {
    # where: (the error's message, the module's `where`, a callback's hook (before the monitors; after them for
    # setup, so that theirs has run), a failing logger, Trainer kwargs)
    "setup": ("setup", None, "setup", False, {}),
    "training_step": ("training_step", "training_step", None, False, {}),
    "callback": ("on_train_batch_end", None, "on_train_batch_end", False, {}),
    "logging_step": ("log_metrics", None, None, True, {}),
    # Validation after every batch, so that one runs inside the logging step (accumulation keeps the step open).
    "validation": ("validation_step", "validation", None, False, {"accumulate_grad_batches": 2, "val_check_interval": 1}),
}


@pytest.mark.parametrize("where", list(FAILURES))
def test_a_failed_fit_leaves_no_hooks_no_gates_and_the_next_fit_equals_a_fresh_one(tmp_path, where):
    message, module_where, hook, failing_logger, kw = FAILURES[where]
    x, y = make_data(world=1, accum=2)
    module = FailingLM(x, y, module_where)
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    monitors = all_monitors(every=None)
    callbacks = [*monitors, FailIn(hook)] if hook == "setup" else [FailIn(hook), *monitors] if hook else monitors
    held = HeldAtFailure(monitors)
    logger = FailingLogger(str(tmp_path), name="failed", version=0) if failing_logger else None
    trainer = _trainer(tmp_path, "failed", [held, *callbacks], logger=logger, gradient_clip_val=0.05, **kw)
    with pytest.raises(Failure, match=message):
        trainer.fit(module)
    # The failure came with hooks registered, and past setup inside a logging step (its gates open, or paused).
    assert held.held["StreamNormMonitor"].get("_handles") == 3 and held.held["LayerNormInputMonitor"].get("_handles") == 6
    if where != "setup":
        assert held.held["LayerNormInputMonitor"].get("_active" if where != "validation" else "_paused"), held.held

    assert _monitor_hooks(module) == [], "hooks left on the model after the failed fit"
    assert {type(m).__name__: _open_state(m) for m in monitors if _open_state(m)} == {}
    # No attribute of ours on the user's objects: the model's modules, the Trainer, the logger's writer.
    users = [*module.modules(), trainer, trainer.logger, trainer.logger.experiment]
    assert [(type(o).__name__, k) for o in users for k in vars(o) if "ln_lightning" in k] == []

    # The next fit, same monitors, same model (its weights reset), equals a fresh model with fresh monitors.
    module.load_state_dict(initial)
    module.where = None
    torch.manual_seed(0)
    _trainer(tmp_path, "again", monitors, gradient_clip_val=0.05, **kw).fit(module)
    fresh = FailingLM(x, y)
    fresh.load_state_dict(initial)
    torch.manual_seed(0)
    _trainer(tmp_path, "fresh", all_monitors(every=None), gradient_clip_val=0.05, **kw).fit(fresh)

    again, reference = read_scalars(tmp_path / "again"), read_scalars(tmp_path / "fresh")
    assert sorted(again) == sorted(reference) and any(t.startswith("ln/") for t in reference)
    for tag, values in reference.items():
        got = again[tag]
        assert [s for s, _ in got] == [s for s, _ in values], (tag, got, values)
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) for (_, a), (_, b) in zip(got, values)), (tag, got, values)
    for (name, a), b in zip(module.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from the fresh run's"
    assert not torch.equal(module.state_dict()["model.head.weight"], initial["model.head.weight"]), "weights did not train"
    assert _monitor_hooks(module) == []  # and teardown removed the second fit's


def test_after_an_exception_on_a_logging_step_no_hook_stays_registered_and_active(tmp_path):
    # The repro: the hooks stayed registered with their gates open, accumulating statistics on every
    # later forward, in evaluation and inference too.
    x, y = make_data(world=1, accum=2)
    module = FailingLM(x, y, "training_step")
    monitors = all_monitors(every=None)
    with pytest.raises(Failure):
        _trainer(tmp_path, "failed", monitors).fit(module)
    assert _monitor_hooks(module) == []
    assert [m._active for m in monitors[:2]] == [False, False]


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_an_exception_outside_fit_is_harmless(tmp_path, stage):
    class Failing(FixedBatchLM):
        def validation_step(self, batch, batch_idx):
            raise Failure(stage)

        test_step = predict_step = validation_step

        def val_dataloader(self):
            return torch.utils.data.DataLoader(range(1), batch_size=None)

        test_dataloader = predict_dataloader = val_dataloader

    x, y = make_data(world=1, accum=1)
    module = Failing(x, y)
    monitors = all_monitors(every=1)
    with pytest.raises(Failure):
        getattr(_trainer(tmp_path, stage, monitors), stage)(module)
    assert _monitor_hooks(module) == [] and [_open_state(m) for m in monitors] == [{}, {}, {}]


def test_an_image_failure_turns_images_off_for_that_fit_only(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ln_lightning.callbacks import StreamNormMonitor, dashboard

    def images(name):
        acc = EventAccumulator(str(tmp_path / name / "version_0"), size_guidance={"images": 0})
        acc.Reload()
        return acc.Tags()["images"]

    x, y = make_data(world=1, accum=1)
    monitor = StreamNormMonitor(every_n_steps=2)
    render = dashboard.DepthProfilePlot.render_png

    def broken(self, *args, **kwargs):
        raise RuntimeError("no image today")

    monkeypatch.setattr(dashboard.DepthProfilePlot, "render_png", broken)
    with pytest.warns(UserWarning, match="no image today"):
        _trainer(tmp_path, "broken", [monitor], max_steps=2).fit(FixedBatchLM(x, y))
    assert images("broken") == [] and "stream/rms/model.blocks.0" in read_scalars(tmp_path / "broken")
    monkeypatch.setattr(dashboard.DepthProfilePlot, "render_png", render)
    _trainer(tmp_path, "mended", [monitor], max_steps=2).fit(FixedBatchLM(x, y))
    assert monitor.log_depth_profile is True and images("mended") == ["stream/depth_profile"]
