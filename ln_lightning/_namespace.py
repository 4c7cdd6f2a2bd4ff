"""Which Lightning namespace (`lightning.pytorch` or `pytorch_lightning`) a class belongs to, and the check that
an ln_lightning callback or plugin is used in a Trainer of its own namespace.

A leaf: it imports neither Lightning nor the rest of ln_lightning, so the monitors (`ln_lightning.callbacks`) and
the plugin both use it without the plugin's Trainer patch (`ln_lightning._lightning_patch`, which re-exports these
names) or its Lightning version guard. Being Lightning-free, it is shared by both namespaces rather than
translated for `pytorch_lightning` (`ln_lightning/pytorch_lightning.py`): each side is read from the classes
themselves.
"""

from __future__ import annotations

from typing import Any

# Written split so that the pytorch_lightning translation, were this module ever added to it, would leave them alone.
_NAMESPACES = {"lightning": "lightning" ".pytorch", "pytorch_lightning": "pytorch_lightning"}


def namespace_of(cls: type) -> str:
    """The Lightning namespace (`lightning.pytorch` or `pytorch_lightning`) a Lightning class comes from."""
    return _NAMESPACES.get(cls.__module__.partition(".")[0], cls.__module__.partition(".")[0])


def _trainer_namespace(cls: type) -> str | None:
    """The Lightning namespace a Trainer class comes from; None for anything else."""
    root, _, rest = cls.__module__.partition(".")
    return _NAMESPACES.get(root) if cls.__name__ == "Trainer" and rest.endswith("trainer.trainer") else None


def _lightning_base_namespace(obj: Any) -> str | None:
    """The namespace of the first Lightning class in `obj`'s class hierarchy (its Callback or LayerSync base)."""
    return next((_NAMESPACES[c.__module__.partition(".")[0]] for c in type(obj).__mro__
                 if c.__module__.partition(".")[0] in _NAMESPACES), None)


def check_same_namespace(trainer: Any, obj: Any) -> None:
    """Refuse `obj` (an ln_lightning plugin or callback) in a Trainer of the other Lightning namespace.

    `lightning.pytorch` and `pytorch_lightning` hold separate classes: the other Trainer would call the hooks
    but its strategies, modules and checkpoints would fail this object's type checks in confusing ways.
    """
    theirs = next((_trainer_namespace(c) for c in type(trainer).__mro__ if _trainer_namespace(c)), None)
    ours = _lightning_base_namespace(obj)
    if theirs is None or ours is None or theirs == ours:  # not a Lightning Trainer (a test double): nothing to compare
        return
    name = type(obj).__name__
    source = "ln_lightning.pytorch_lightning" if theirs == "pytorch_lightning" else "ln_lightning"
    raise TypeError(
        f"{name} was imported for {ours} ({type(obj).__module__}), but this Trainer is a {theirs}.Trainer: "
        f"{ours} and {theirs} are separate packages with separate classes and can't be mixed in one Trainer. "
        f"Use `from {source} import {name}` with {theirs}, or build the Trainer from {ours}."
    )
