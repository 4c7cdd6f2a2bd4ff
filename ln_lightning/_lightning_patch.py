"""Everything of ln_lightning that touches a Lightning internal, in one version-guarded module.

Why a patch at all: `Trainer(plugins=[...])` only accepts Precision, CheckpointIO, ClusterEnvironment and
LayerSync objects, and the Trainer calls a LayerSync only from the DDP and FSDP strategies' `setup`, which
on single-device/DDP runs *after* checkpoint weights are restored (and never on one device or under
ModelParallelStrategy). `LNPlacement` therefore does its work as a Callback (`setup` runs before
`configure_model`, checkpoint restore and `configure_optimizers` on every strategy). Nothing in the
Trainer turns a plugin into a callback, with a spawn launcher the main process never runs any hook at all,
and no hook runs between a LightningModule's `configure_model` and the checkpoint restore after it, so two
functions of `lightning.pytorch.trainer.call` are wrapped, process-wide, once (:func:`install`, called once
where `ln_lightning.plugin` is imported, never by a constructor; :func:`uninstall` undoes it, after which an
`LNPlacement` refuses to be built rather than be ignored; the monitors in `ln_lightning.callbacks` need none of
this):

* `_call_and_handle_interrupt`, the funnel that `fit`, `validate`, `test` and `predict` pass through in the
  main process before any process is launched. For a Trainer that holds an `LNPlacement` (as a plugin or a
  callback; any other Trainer is passed through untouched) it registers the `LNPlacement` as the trainer's
  first callback (if it was given as a plugin), and, for `fit` under a spawn/fork launcher (`ddp_spawn`,
  `ddp_fork`, ...), rewrites the main process's model before launching, so that the weights rank 0 sends
  back at the end (loaded with `strict=False` by Lightning) land in a model of the same architecture
  instead of silently dropping the added modules.
* `_call_configure_model`: after the LightningModule's `configure_model`, the `LNPlacement` of that Trainer
  rewrites layers built there (`LNPlacement.after_configure_model`), still before the checkpoint restore and
  `configure_optimizers`. Nothing is set on the user's module.

`install()` is idempotent and refuses Lightning versions outside the tested range. The other internals
read here: the Trainer's LayerSync plugin (`trainer._accelerator_connector._layer_sync`, in
:func:`find_placements`) and the spawn launcher's class (`_MultiProcessingLauncher`). This module imports nothing
from the rest of ln_lightning but the leaf `ln_lightning._namespace`: the plugin module registers its class
(:func:`register_placement_class`), and the entry calls only that class's public methods (`check_strategy`,
`rewrite`, `after_configure_model`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import lightning
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer import call as _call
from lightning.pytorch.trainer.states import TrainerFn

# Moved to a Lightning-free leaf that the monitors use without this module; re-exported for the plugin.
from ln_lightning._namespace import check_same_namespace, namespace_of  # noqa: F401

# The range this patch was written against and CI tests (lightning / pytorch_lightning 2.5.6 and 2.6.6).
# Outside it `install` raises: an untested patch could silently stop applying the rewrite.
TESTED_LIGHTNING = ((2, 5), (2, 7))  # [min, max)

_MARK = "__ln_lightning_patched__"
_placement_type: type | None = None  # the plugin class the entry looks for (LNPlacement)


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def lightning_version_supported(version: str | None = None) -> bool:
    v = _version_tuple(version or lightning.__version__)
    return TESTED_LIGHTNING[0] <= v < TESTED_LIGHTNING[1]


def check_version() -> None:
    """Raise RuntimeError (naming the alternative) when the installed Lightning is outside the tested range."""
    if not lightning_version_supported():
        raise RuntimeError(_unsupported_version_message(lightning.__version__))


def _unsupported_version_message(version: str) -> str:
    lo, hi = TESTED_LIGHTNING
    return (
        f"ln_lightning's LNPlacement is tested with lightning >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}; found lightning "
        f"{version}. Rather than risk a silent no-op, it refuses to run. Alternative: call "
        "ln_lightning.convert(model, ...) yourself before trainer.fit(model), and drop LNPlacement from the Trainer."
    )




def overrides_configure_model(module: Any) -> bool:
    """Whether the LightningModule's class defines its own `configure_model` (layers may be built there)."""
    return getattr(type(module), "configure_model", None) is not LightningModule.configure_model


def register_placement_class(cls: type) -> type:
    """Class decorator: `cls` (LNPlacement) is what :func:`find_placements` and the Trainer entry look for."""
    global _placement_type
    _placement_type = cls
    return cls


def find_placements(trainer: Any) -> list:
    """The placement plugins (the registered class) a Trainer holds, as its LayerSync plugin or as callbacks."""
    if _placement_type is None:  # the plugin module was never imported: no placement object can exist
        return []
    found: list = []
    connector = getattr(trainer, "_accelerator_connector", None)
    layer_sync = getattr(connector, "_layer_sync", None)
    if isinstance(layer_sync, _placement_type):
        found.append(layer_sync)
    for cb in trainer.callbacks:
        if isinstance(cb, _placement_type) and all(cb is not f for f in found):
            found.append(cb)
    return found


def _before_trainer_entry(trainer: Any) -> None:
    """Called by the patch in the main process at the start of fit/validate/test/predict."""
    placements = find_placements(trainer)
    if not placements:
        return
    if len(placements) > 1:
        raise ValueError(
            f"the Trainer holds {len(placements)} LNPlacement objects ({placements}); a model has one placement: "
            "keep one."
        )
    placement = placements[0]
    if all(cb is not placement for cb in trainer.callbacks):
        # First, so callbacks that hook LayerNorms in their own `setup` see the rewritten model.
        trainer.callbacks.insert(0, placement)
    launcher = trainer.strategy.launcher
    if (
        isinstance(launcher, _MultiProcessingLauncher)
        and trainer.state.fn == TrainerFn.FITTING
        and trainer.lightning_module is not None
    ):
        # Spawn/fork: the workers get a copy of this model and rank 0 sends its weights back at the end with
        # load_state_dict(strict=False); rewrite here first so modules the rewrite adds are not dropped.
        placement.check_strategy(trainer.strategy)
        module = trainer.lightning_module
        try:
            placement.rewrite(module)
        except Exception as err:  # layers built in configure_model, which the main process never runs
            if not (overrides_configure_model(module) and type(err).__name__ == "PlacementError"):
                raise


def _after_configure_model(trainer: Any) -> None:
    for placement in find_placements(trainer):
        placement.after_configure_model(trainer, trainer.lightning_module)


def is_installed() -> bool:
    return getattr(_call._call_and_handle_interrupt, _MARK, False) and getattr(_call._call_configure_model, _MARK, False)


def install() -> None:
    """Wrap `call._call_and_handle_interrupt` and `call._call_configure_model` once (idempotent)."""
    if is_installed():
        return
    check_version()
    if not getattr(_call._call_and_handle_interrupt, _MARK, False):
        original = _call._call_and_handle_interrupt

        @functools.wraps(original)  # the original stays reachable as `__wrapped__`
        def _call_and_handle_interrupt(trainer: Any, trainer_fn: Callable, *args: Any, **kwargs: Any) -> Any:
            _before_trainer_entry(trainer)
            return original(trainer, trainer_fn, *args, **kwargs)

        setattr(_call_and_handle_interrupt, _MARK, True)
        _call._call_and_handle_interrupt = _call_and_handle_interrupt
    if not getattr(_call._call_configure_model, _MARK, False):
        original_configure = _call._call_configure_model

        @functools.wraps(original_configure)
        def _call_configure_model(trainer: Any) -> None:
            original_configure(trainer)
            _after_configure_model(trainer)

        setattr(_call_configure_model, _MARK, True)
        _call._call_configure_model = _call_configure_model


def uninstall() -> None:
    """Undo :func:`install`: Lightning's own functions again (idempotent). A Trainer holding an `LNPlacement`
    would then never call it, so `LNPlacement` refuses to be built until :func:`install` runs again."""
    for name in ("_call_and_handle_interrupt", "_call_configure_model"):
        fn = getattr(_call, name)
        if getattr(fn, _MARK, False):
            setattr(_call, name, fn.__wrapped__)


def check_installed() -> None:
    """Raise RuntimeError when the patch is not in place (uninstalled): the plugin would silently not apply."""
    if not is_installed():
        raise RuntimeError(
            "LNPlacement needs ln_lightning's Lightning patch (ln_lightning._lightning_patch), which was uninstalled "
            "in this process: a Trainer would never call the plugin, and the model would train unchanged. Call "
            "ln_lightning._lightning_patch.install() again before building LNPlacement."
        )
