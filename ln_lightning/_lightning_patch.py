"""The one place where ln_lightning touches a Lightning internal.

Why a patch at all: `Trainer(plugins=[...])` only accepts Precision, CheckpointIO, ClusterEnvironment and
LayerSync objects, and the Trainer calls a LayerSync only from the DDP and FSDP strategies' `setup`, which
on single-device/DDP runs *after* checkpoint weights are restored (and never on one device or under
ModelParallelStrategy). `LNPlacement` therefore does its work as a Callback (`setup` runs before
`configure_model`, checkpoint restore and `configure_optimizers` on every strategy). Nothing in the
Trainer turns a plugin into a callback, and with a spawn launcher the main process never runs any hook at
all, so one function is wrapped: `lightning.pytorch.trainer.call._call_and_handle_interrupt`, the funnel
that `fit`, `validate`, `test` and `predict` pass through in the main process before any process is
launched. The wrapper:

* does nothing unless the trainer holds an `LNPlacement` (as a plugin or a callback);
* registers the `LNPlacement` as the trainer's first callback (if it was given as a plugin);
* for `fit` under a spawn/fork launcher (`ddp_spawn`, `ddp_fork`, ...), rewrites the main process's model
  before launching, so that the weights rank 0 sends back at the end (loaded with `strict=False` by
  Lightning) land in a model of the same architecture instead of silently dropping the added modules.

`install()` is idempotent and refuses Lightning versions outside the tested range.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import lightning
from lightning.pytorch.trainer import call as _call

# The range this patch was written against and CI tests (lightning / pytorch_lightning 2.5.6 and 2.6.6).
# Outside it `install` raises: an untested patch could silently stop applying the rewrite.
TESTED_LIGHTNING = ((2, 5), (2, 7))  # [min, max)

_MARK = "__ln_lightning_patched__"


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def lightning_version_supported(version: str | None = None) -> bool:
    v = _version_tuple(version or lightning.__version__)
    return TESTED_LIGHTNING[0] <= v < TESTED_LIGHTNING[1]


def _unsupported_version_message(version: str) -> str:
    lo, hi = TESTED_LIGHTNING
    return (
        f"ln_lightning's LNPlacement is tested with lightning >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}; found lightning "
        f"{version}. Rather than risk a silent no-op, it refuses to run. Alternative: call "
        "ln_lightning.convert(model, ...) yourself before trainer.fit(model), and drop LNPlacement from the Trainer."
    )


# Written split so that the pytorch_lightning translation (ln_lightning/pytorch_lightning.py), which renames
# this spelling everywhere in this file, leaves these names alone.
_NAMESPACES = {"lightning": "lightning" ".pytorch", "pytorch_lightning": "pytorch_lightning"}


def namespace_of(cls: type) -> str:
    """The Lightning namespace (`lightning.pytorch` or `pytorch_lightning`) a Lightning class comes from."""
    return _NAMESPACES.get(cls.__module__.partition(".")[0], cls.__module__.partition(".")[0])


def _namespace(cls: type) -> str | None:
    """The Lightning namespace a Trainer class comes from; None for anything else."""
    root, _, rest = cls.__module__.partition(".")
    return _NAMESPACES.get(root) if cls.__name__ == "Trainer" and rest.endswith("trainer.trainer") else None


def check_same_namespace(trainer: Any, obj: Any) -> None:
    """Refuse `obj` (an ln_lightning plugin or callback) in a Trainer of the other Lightning namespace.

    `lightning.pytorch` and `pytorch_lightning` hold separate classes: the other Trainer would call the hooks
    but its strategies, modules and checkpoints would fail this object's type checks in confusing ways.
    """
    from lightning.pytorch import Trainer

    if isinstance(trainer, Trainer):
        return
    theirs = next((_namespace(c) for c in type(trainer).__mro__ if _namespace(c)), None)
    ours = _namespace(Trainer)
    if theirs is None or theirs == ours:  # not a Lightning Trainer (a test double): nothing to compare
        return
    name = type(obj).__name__
    source = "ln_lightning.pytorch_lightning" if theirs == "pytorch_lightning" else "ln_lightning"
    raise TypeError(
        f"{name} was imported for {ours} ({type(obj).__module__}), but this Trainer is a {theirs}.Trainer: "
        f"{ours} and {theirs} are separate packages with separate classes and can't be mixed in one Trainer. "
        f"Use `from {source} import {name}` with {theirs}, or build the Trainer from {ours}."
    )


def is_installed() -> bool:
    return getattr(_call._call_and_handle_interrupt, _MARK, False)


def install() -> None:
    """Wrap `call._call_and_handle_interrupt` once (idempotent)."""
    if is_installed():
        return
    if not lightning_version_supported():
        raise RuntimeError(_unsupported_version_message(lightning.__version__))
    original = _call._call_and_handle_interrupt

    @functools.wraps(original)
    def _call_and_handle_interrupt(trainer: Any, trainer_fn: Callable, *args: Any, **kwargs: Any) -> Any:
        from ln_lightning.plugin import _before_trainer_entry  # late: plugin imports this module

        _before_trainer_entry(trainer)
        return original(trainer, trainer_fn, *args, **kwargs)

    setattr(_call_and_handle_interrupt, _MARK, True)
    _call_and_handle_interrupt.__ln_lightning_original__ = original  # type: ignore[attr-defined]
    _call._call_and_handle_interrupt = _call_and_handle_interrupt


def uninstall() -> None:
    """Restore Lightning's own function (for tests)."""
    fn = _call._call_and_handle_interrupt
    if getattr(fn, _MARK, False):
        _call._call_and_handle_interrupt = fn.__ln_lightning_original__
