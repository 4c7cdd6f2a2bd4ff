"""ln-lightning: LayerNorm placement in residual and transformer models as a one-line, measured choice.

    from lightning import Trainer
    from ln_lightning import LNPlacement
    Trainer(plugins=[LNPlacement("pre")]).fit(model)

The names below load lazily, so `import ln_lightning` stays cheap (no Lightning, no Triton)
for users who only want `inspect_model` / `convert`.
"""

from __future__ import annotations

import importlib

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
    # fused norm
    "FusedLayerNorm": "ln_lightning.norm",
    "FusedAddLayerNorm": "ln_lightning.norm",
    "fused_add_layer_norm": "ln_lightning.norm",
    "swap_layernorms": "ln_lightning.norm",
    # Lightning plugin
    "LNPlacement": "ln_lightning.plugin",
    "load_converted": "ln_lightning.plugin",
    "UnsupportedStrategyError": "ln_lightning.plugin",
    "accept_unconverted": "ln_lightning.rewrite_record",
    # monitors
    "StreamNormMonitor": "ln_lightning.callbacks",
    "LayerNormInputMonitor": "ln_lightning.callbacks",
    "ClipAttributionMonitor": "ln_lightning.callbacks",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ln_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
