"""What the layers above the engine add to a model when a rewrite state is attached to it, and take away on detach.

The engine (``placement/``) imports nothing above it, yet a converted Hugging Face model's own ``save_pretrained``
must write the safe form (``export.save_guard``). The package root registers that guard here, and Python runs the
root before any of its modules, so :func:`ln_lightning.placement.state.attach` never runs without it. A leaf: it
imports nothing, so ``from ln_lightning import LNLightningWarning`` stays free of torch.
"""

from __future__ import annotations

from typing import Any, Callable

_HOOKS: list[tuple[Callable[[Any, Any], None], Callable[[Any], None]]] = []


def register(install: Callable[[Any, Any], None], uninstall: Callable[[Any], None]) -> None:
    """Run ``install(root, state)`` on every attach and ``uninstall(root)`` on every detach from now on (a pair
    registered again changes nothing)."""
    if (install, uninstall) not in _HOOKS:
        _HOOKS.append((install, uninstall))


def installs() -> list[Callable[[Any, Any], None]]:
    return [install for install, _ in _HOOKS]


def uninstalls() -> list[Callable[[Any], None]]:
    return [uninstall for _, uninstall in _HOOKS]


__all__ = ["installs", "register", "uninstalls"]
