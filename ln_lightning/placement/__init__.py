"""The placement engine: recognise residual blocks, rewrite where their norms sit, report.

Layers, each importing only those below it: ``errors``, ``options`` and ``spec`` (the request); ``reading/`` (what
the model is: blocks, norms, traced forwards, the registry); ``checking/`` (a rewritten block against its formula);
``rewrite/`` (the hooks, branch scales, final norms, fused norms, exact reparameterisations); ``migrate/`` (the
transition of a trained model); ``families/`` (block handlers for libraries); ``state`` (what the model holds of
its rewrite) and ``engine`` (``convert`` / ``inspect_model``) over them all; ``report`` (what they say).
"""

import importlib as _importlib
import sys as _sys

from ln_lightning.placement.engine import convert, inspect_model
from ln_lightning.placement.errors import PlacementError
from ln_lightning.placement.rewrite.hooks import bypass, is_deferred
from ln_lightning.placement.options import validate_options
from ln_lightning.placement.reading.registry import Sublayer, register_block, register_norm_class, unregister_block
from ln_lightning.placement.report import ConversionReport, PlacementReport

__all__ = [
    "convert", "inspect_model", "validate_options", "PlacementError", "Sublayer", "register_block",
    "register_norm_class", "unregister_block", "ConversionReport", "PlacementReport", "bypass", "is_deferred",
]

# The modules moved into subpackages (issue 32) still import by their old names, for one release: a model pickled
# whole (torch.save) names its classes' modules.
_MOVED = {
    "analysis": "reading.analysis", "blocks": "reading.blocks", "discovery": "reading.discovery", "norms": "reading.norms",
    "recording": "reading.recording", "registry": "reading.registry", "apply": "rewrite.apply", "hooks": "rewrite.hooks",
    "scale": "rewrite.scale", "final_norm": "rewrite.final_norm", "fused_layers": "rewrite.fused_layers",
    "transaction": "rewrite.transaction", "plan": "rewrite.sublayer_plan", "stream_scale": "rewrite.stream_scale",
    "checks": "checking.checks", "black_box": "checking.black_box", "compare": "checking.compare",
    "isolation": "checking.isolation", "blend": "migrate.blend", "teacher": "migrate.teacher",
    "trained_change": "migrate.trained_change", "transition": "migrate.transition",
    "transition_control": "migrate.transition_control",
}
for _old, _new in _MOVED.items():
    _sys.modules.setdefault(f"{__name__}.{_old}", _importlib.import_module(f"{__name__}.{_new}"))
