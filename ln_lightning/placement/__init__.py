"""The placement engine: recognise residual blocks, rewrite where their norms sit, report."""

from ln_lightning.placement.engine import convert, inspect_model
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.hooks import bypass, is_deferred
from ln_lightning.placement.options import validate_options
from ln_lightning.placement.registry import Sublayer, register_block, register_norm_class, unregister_block
from ln_lightning.placement.report import ConversionReport, PlacementReport

__all__ = [
    "convert", "inspect_model", "validate_options", "PlacementError", "Sublayer", "register_block",
    "register_norm_class", "unregister_block", "ConversionReport", "PlacementReport", "bypass", "is_deferred",
]
