"""ln_lightning for the standalone ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

    import pytorch_lightning as pl
    from ln_lightning.pytorch_lightning import LNPlacement, StreamNormMonitor

    pl.Trainer(plugins=[LNPlacement("pre")], callbacks=[StreamNormMonitor()]).fit(model)

``lightning.pytorch`` and ``pytorch_lightning`` are the same code under two package names, with separate
classes: a ``pytorch_lightning.Trainer`` accepts only ``pytorch_lightning`` plugins and callbacks. The names
here are ln_lightning's Lightning-facing modules (``ln_lightning.plugin``, ``ln_lightning.checkpoint``,
``ln_lightning.callbacks``, ``ln_lightning._lightning_patch``) loaded a second time with ``lightning.pytorch``
read as ``pytorch_lightning`` and ``lightning.fabric`` as ``lightning_fabric`` - the renaming Lightning's own
release applies to produce the ``pytorch_lightning`` package. One code base, and honest classes: this
``LNPlacement`` is a ``pytorch_lightning`` ``LayerSync`` and ``Callback``, not a ``lightning.pytorch`` one.
The placement engine (the rewrite state included), the fused norm and :class:`ln_lightning.LNLightningWarning`
use no Lightning class and are shared, so checkpoints move freely between the two namespaces.

Using the ``lightning.pytorch`` objects (``from ln_lightning import ...``) in a ``pytorch_lightning``
Trainer, or these in a ``lightning.pytorch`` one, is refused at ``setup`` with an error naming both.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import re
import sys
from typing import TYPE_CHECKING

try:
    import pytorch_lightning as _pl  # noqa: F401 - the namespace this module serves
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"ln_lightning.pytorch_lightning needs the pytorch_lightning package ({err}); install it with "
        "`pip install pytorch-lightning` (the same version as `lightning`), or use `from ln_lightning import ...` "
        "with `lightning.pytorch`."
    ) from None

# The modules that import Lightning classes, and the callbacks modules they import (the rest of the package is
# Lightning-free and shared).
_CLONED = frozenset({
    "_distill",
    "_plugin_arguments",
    "_lightning_patch",
    "_transition_run",
    "checkpoint",
    "plugin",
    "callbacks",
    "callbacks._common",
    "callbacks._lightning_internals",
    "callbacks._placement_lookup",
    "callbacks._reduce",
    "callbacks.clip",
    "callbacks._grad_groups",
    "callbacks.dashboard",
    "callbacks.layernorm",
    "callbacks.spike",
    "callbacks.stream",
})
_PREFIX = __name__ + "."
_CLONED_TOP = sorted({name.split(".")[0] for name in _CLONED})

# Each replacement keeps the line count, so tracebacks and line numbers match the original source file.
_RENAMES = (
    (re.compile(r"\bln_lightning\.(" + "|".join(_CLONED_TOP) + r")\b"), _PREFIX + r"\1"),
    (re.compile(r"\blightning\.pytorch\b"), "pytorch_lightning"),
    (re.compile(r"\blightning\.fabric\b"), "lightning_fabric"),
    (re.compile(r"^(\s*)import lightning$", re.M), r"\1import pytorch_lightning as lightning"),
)
_FROM_PACKAGE = re.compile(r"^(\s*)from ln_lightning import ([\w, ]+)$", re.M)


def _split_package_import(match: re.Match) -> str:
    """`from ln_lightning import _lightning_patch, _warnings` -> the cloned name from here, the rest as is."""
    indent, names = match.group(1), [n.strip() for n in match.group(2).split(",")]
    cloned = [n for n in names if n in _CLONED]
    shared = [n for n in names if n not in _CLONED]
    parts = ([f"from ln_lightning import {', '.join(shared)}"] if shared else []) + (
        [f"from {__name__} import {', '.join(cloned)}"] if cloned else [])
    return indent + "; ".join(parts)


def _translate(source: str) -> str:
    source = _FROM_PACKAGE.sub(_split_package_import, source)
    for pattern, replacement in _RENAMES:
        source = pattern.sub(replacement, source)
    return source


class _Loader(importlib.abc.Loader):
    def __init__(self, origin: str):
        self.origin = origin

    def create_module(self, spec):  # default module creation
        return None

    def exec_module(self, module) -> None:
        with open(self.origin, encoding="utf-8") as f:
            source = _translate(f.read())
        # Compiled from the translated text (never the original's cached bytecode), under the original's path.
        exec(compile(source, self.origin, "exec", dont_inherit=True), module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_PREFIX) or fullname[len(_PREFIX):] not in _CLONED:
            return None
        original = importlib.util.find_spec("ln_lightning." + fullname[len(_PREFIX):])
        if original is None or original.origin is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, original.origin, loader=_Loader(original.origin),
            # a package (callbacks) gets an empty search path: its submodules come from this finder
            submodule_search_locations=[] if original.submodule_search_locations is not None else None,
        )


# A package without a directory: its submodules are the translated clones `_Finder` provides.
__path__: list[str] = []

if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())

# Imported eagerly (also in spawned workers that unpickle these classes): the names a Trainer takes.
from ln_lightning.pytorch_lightning.callbacks import (  # noqa: E402
    ClipAttributionMonitor,
    LayerNormInputMonitor,
    StreamNormMonitor,
)
from ln_lightning.pytorch_lightning.plugin import LNPlacement, UnsupportedStrategyError, load_converted  # noqa: E402

if TYPE_CHECKING:  # to a type checker these are the lightning.pytorch classes' twins
    from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor  # noqa: F811
    from ln_lightning.plugin import LNPlacement, UnsupportedStrategyError, load_converted  # noqa: F811

__all__ = [
    "ClipAttributionMonitor",
    "LNPlacement",
    "LayerNormInputMonitor",
    "StreamNormMonitor",
    "UnsupportedStrategyError",
    "load_converted",
]
