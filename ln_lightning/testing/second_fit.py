"""A fit after a failed fit, against the same fit in a fresh process (issue 23: nothing left behind).

`clean_fit(out)` fits a seeded CharLM with `LNPlacement(transition_steps=...)`, the three monitors, gradient
clipping and a TensorBoard logger, and writes its final weights and every logged scalar. `after_a_failure(out)`
first runs a fit of another model that fails on a logging step, then a fit of the seeded model that fails in
setup (after the plugin rewrote it and the monitors hooked it), then `clean_fit` of that same model object.
Run as a script (`python -m ln_lightning.testing.second_fit clean OUT`) for the fresh-process side.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from ln_lightning import LNPlacement
from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor
from ln_lightning.demo.lightning import CharLM
from ln_lightning.testing.monitors import read_scalars
from ln_lightning.testing.plugin import TINY, loader


class _Fail(Callback):
    def __init__(self, step: int | None):
        self.step = step  # None: in setup

    def setup(self, trainer, pl_module, stage):
        if self.step is None:
            raise RuntimeError("a failure in setup")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("a failure on a logging step")


def _seeded_model() -> CharLM:
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    return CharLM(**TINY)


def _fit(model: CharLM, out: str, name: str, extra=()) -> CharLM:
    seed_everything(1, verbose=False)  # the data order and dropout: the same for every fit that gets here
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=4, log_every_n_steps=2, gradient_clip_val=0.5,
                      logger=TensorBoardLogger(out, name=name, version=""), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
                      plugins=[LNPlacement("pre", transition_steps=3, fused=False)],
                      callbacks=[StreamNormMonitor(), LayerNormInputMonitor(), ClipAttributionMonitor(), *extra])
    trainer.fit(model, train_dataloaders=loader(16, shuffle=True))
    return model


def clean_fit(out: str, model: CharLM | None = None) -> None:
    model = _fit(model if model is not None else _seeded_model(), out, "clean")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, "clean_weights.pt"))
    with open(os.path.join(out, "clean_scalars.json"), "w") as f:
        json.dump(read_scalars(os.path.join(out, "clean")), f)


def _expect_failure(fn, what: str) -> None:
    try:
        fn()
    except RuntimeError as err:
        if what not in str(err):
            raise
    else:
        raise AssertionError(f"the fit did not fail ({what})")


def hooks_of_callbacks(model: torch.nn.Module) -> list[str]:
    """Hooks on `model` defined in ln_lightning's callbacks (the monitors): none may outlive their fit."""
    left = []
    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_ln_pre_hooks",
                     "_ln_post_hooks"):
            for h in (m.__dict__.get(attr) or {}).values():
                code = getattr(h, "__code__", None) or getattr(getattr(h, "__call__", None), "__code__", None)
                if code is not None and "ln_lightning/callbacks" in code.co_filename.replace("\\", "/"):
                    left.append(f"{name or '<root>'}.{attr}")
    return left


def after_a_failure(out: str) -> None:
    other = _seeded_model()
    _expect_failure(lambda: _fit(other, out, "failed_step", [_Fail(2)]), "logging step")
    model = _seeded_model()
    _expect_failure(lambda: _fit(model, out, "failed_setup", [_Fail(None)]), "in setup")
    with open(os.path.join(out, "left.json"), "w") as f:
        json.dump({"after_step_failure": hooks_of_callbacks(other), "after_setup_failure": hooks_of_callbacks(model),
                   "attributes": sorted(set(vars(model)) - set(vars(_seeded_model())))}, f)
    clean_fit(out, model)


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    if mode != "clean":
        raise SystemExit(f"unknown mode {mode}")
    clean_fit(out_dir)
