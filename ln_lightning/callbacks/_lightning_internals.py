"""Every Lightning internal the monitors read, in one place (lightning / pytorch_lightning 2.5 and 2.6).

- The logging clock, `trainer.fit_loop.epoch_loop._batches_that_stepped`: the step number `self.log` writes
  under (`_LoggerConnector.log_metrics`) and `LearningRateMonitor` logs at. Under manual optimisation it counts
  training batches, not optimizer steps (`global_step` counts every `optimizer.step()` of every optimizer); under
  gradient accumulation it counts optimizer steps; a checkpoint restores it.
- Whether the current training batch ends an optimizer step, `trainer.fit_loop._should_accumulate()`: what
  Lightning's own logging checks before writing a training step's metrics (`update_train_step_metrics`).
- The Trainer's LayerSync plugin, `trainer._accelerator_connector._layer_sync`: where an `LNPlacement` given
  as a plugin sits before its first `fit` (the dashboard's transition chart looks for it).

This module imports nothing and touches no Lightning state: it reads attributes. `check_readable` runs at the
monitors' `setup`, so a Lightning release that renames one of them fails there, naming it, instead of the
monitors quietly logging at the wrong steps.
"""

from __future__ import annotations

import sys
from typing import Any


def logging_step(trainer: Any) -> int:
    """The step number Lightning's own training logging uses now (read it in a training batch's hooks)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def batch_ends_optimizer_step(trainer: Any) -> bool:
    """Whether the current training batch is the last micro-batch of its optimizer step (always, under manual
    optimisation: Lightning then refuses `accumulate_grad_batches > 1`)."""
    return not trainer.fit_loop._should_accumulate()


def layer_sync_plugin(trainer: Any) -> Any:
    """The Trainer's LayerSync plugin (`Trainer(plugins=[...])`), or None."""
    return getattr(getattr(trainer, "_accelerator_connector", None), "_layer_sync", None)


def check_readable(trainer: Any) -> None:
    """Raise RuntimeError naming what is missing when this Lightning lacks an internal the monitors read."""
    missing = []
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if not isinstance(getattr(epoch_loop, "_batches_that_stepped", None), int):
        missing.append("trainer.fit_loop.epoch_loop._batches_that_stepped")
    if not callable(getattr(getattr(trainer, "fit_loop", None), "_should_accumulate", None)):
        missing.append("trainer.fit_loop._should_accumulate()")
    if missing:
        package = type(trainer).__module__.partition(".")[0]  # lightning or pytorch_lightning
        version = getattr(sys.modules.get(package), "__version__", "of unknown version")
        raise RuntimeError(
            f"ln_lightning monitors: this Lightning ({package} {version}) has no {' and no '.join(missing)}, "
            "which the monitors read to log at the steps Lightning's own logging uses (tested with lightning 2.5 "
            "and 2.6). Use a tested Lightning version, or drop the monitors from the Trainer."
        )
