"""ln-lightning: LayerNorm placement in residual and transformer models as a one-line, measured choice.

    from lightning import Trainer
    from ln_lightning import LNPlacement
    Trainer(plugins=[LNPlacement("pre")]).fit(model)

The names below load lazily, so `import ln_lightning` stays cheap (no Lightning, no Triton)
for users who only want `inspect_model` / `convert`. Type checkers and IDEs see them through the
`TYPE_CHECKING` imports below, which mirror `_EXPORTS` (tests/test_packaging.py keeps the two equal).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ln_lightning import _attach_hooks

# The one place the version is written: pyproject.toml reads it ([tool.setuptools.dynamic]).
__version__ = "0.1.0"

_EXPORTS = {
    # placement engine
    "inspect_model": "ln_lightning.placement",
    "convert": "ln_lightning.placement",
    "register_block": "ln_lightning.placement",
    "register_norm_class": "ln_lightning.placement",
    "Sublayer": "ln_lightning.placement",
    "PlacementReport": "ln_lightning.placement",
    "ConversionReport": "ln_lightning.placement",
    "PlacementError": "ln_lightning.placement",
    # exact rewrites of a model's norms
    "to_rmsnorm": "ln_lightning.exact",
    "fold_norms": "ln_lightning.exact",
    "ExactRewriteReport": "ln_lightning.exact",
    # fused norm
    "FusedLayerNorm": "ln_lightning.norm",
    "FusedAddLayerNorm": "ln_lightning.norm",
    "fused_add_layer_norm": "ln_lightning.norm",
    "swap_layernorms": "ln_lightning.norm",
    # Lightning plugin
    "LNPlacement": "ln_lightning.plugin",
    "load_converted": "ln_lightning.checkpoint",
    "PlacementSpec": "ln_lightning.placement.spec",
    "TransitionSpec": "ln_lightning.placement.spec",
    "UnsupportedStrategyError": "ln_lightning.plugin",
    "accept_unconverted": "ln_lightning.placement.state",
    # shipping a converted model
    "save_pretrained": "ln_lightning.export.hf",
    "from_pretrained": "ln_lightning.export.hf",
    "to_native": "ln_lightning.export.native",
    # monitors
    "StreamNormMonitor": "ln_lightning.callbacks",
    "LayerNormInputMonitor": "ln_lightning.callbacks",
    "ClipAttributionMonitor": "ln_lightning.callbacks",
    "SpikeMonitor": "ln_lightning.callbacks",
    # warnings (a leaf module: importing it pulls in nothing)
    "LNLightningWarning": "ln_lightning._warnings",
    "LNLightningDeprecationWarning": "ln_lightning._warnings",
}

if TYPE_CHECKING:  # static view of the lazy names above, for type checkers and IDEs
    from ln_lightning._warnings import LNLightningDeprecationWarning, LNLightningWarning
    from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, SpikeMonitor, StreamNormMonitor
    from ln_lightning.exact import ExactRewriteReport, fold_norms, to_rmsnorm
    from ln_lightning.export.hf import from_pretrained, save_pretrained
    from ln_lightning.export.native import to_native
    from ln_lightning.norm import FusedAddLayerNorm, FusedLayerNorm, fused_add_layer_norm, swap_layernorms
    from ln_lightning.placement import (
        ConversionReport,
        PlacementError,
        PlacementReport,
        Sublayer,
        convert,
        inspect_model,
        register_block,
        register_norm_class,
    )
    from ln_lightning.checkpoint import load_converted
    from ln_lightning.plugin import LNPlacement, UnsupportedStrategyError
    from ln_lightning.placement.spec import PlacementSpec, TransitionSpec
    from ln_lightning.placement.state import accept_unconverted

# A literal list, so that static tools read it (sorted(_EXPORTS) + [...] is opaque to them).
__all__ = [
    "ClipAttributionMonitor",
    "ConversionReport",
    "ExactRewriteReport",
    "FusedAddLayerNorm",
    "FusedLayerNorm",
    "LNLightningDeprecationWarning",
    "LNLightningWarning",
    "LNPlacement",
    "LayerNormInputMonitor",
    "PlacementError",
    "PlacementReport",
    "PlacementSpec",
    "SpikeMonitor",
    "StreamNormMonitor",
    "Sublayer",
    "TransitionSpec",
    "UnsupportedStrategyError",
    "__version__",
    "accept_unconverted",
    "convert",
    "fold_norms",
    "from_pretrained",
    "fused_add_layer_norm",
    "inspect_model",
    "load_converted",
    "register_block",
    "register_norm_class",
    "save_pretrained",
    "swap_layernorms",
    "to_native",
    "to_rmsnorm",
]


# The engine (placement/) imports nothing above it; the package root, which Python runs before any of its modules,
# gives its rewrite state the export layer's save guard: a converted Hugging Face model's own save_pretrained writes
# the safe form, whichever module a user imported first (tests/test_export_hf.py). The guard's module loads with the
# first rewrite, not with the package (``from ln_lightning import LNLightningWarning`` imports no torch).
def _save_guard(action: str):
    def run(*args) -> None:
        from ln_lightning.export import save_guard

        getattr(save_guard, action)(*args)

    run.__qualname__ = f"save_guard.{action}"
    return run


_attach_hooks.register(_save_guard("install"), _save_guard("uninstall"))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ln_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
