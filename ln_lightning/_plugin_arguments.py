"""LNPlacement's arguments as the request they spell: a `PlacementSpec` (with its `TransitionSpec`) and a LayerSync.

The keywords that `PlacementSpec` and `TransitionSpec` replaced (ln_lightning 0.4) are translated here, each with a
deprecation warning that shows the new spelling, for one release; contradictions between the old and new spellings
are refused. The warnings' stacklevel names the user's `LNPlacement(...)` line (called from `LNPlacement.__init__`).
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

from ln_lightning._warnings import LNLightningDeprecationWarning
from ln_lightning.placement import PlacementError
from ln_lightning.placement.spec import PlacementSpec, TransitionSpec, coerce_placement

# The keywords `transition=TransitionSpec(...)` replaced (ln_lightning 0.4), kept for one release: -> its field.
_DEPRECATED = {"transition_steps": "steps", "transition_schedule": "schedule", "transition_stream_scale": "stream_scale",
               "transition_endpoint_fraction": "endpoint_fraction", "transition_distill": "distill"}
# The keywords `PlacementSpec(...)` replaced (ln_lightning 0.4), kept for one release: they are its fields.
_DEPRECATED_SPEC = ("final_norm", "branch_scale", "layerscale_init", "mix_post_blocks")


def placement_spec(placement: Any, transition: Any, layer_sync: Any, deprecated: dict) -> tuple[PlacementSpec, Any]:
    """The PlacementSpec and LayerSync that LNPlacement's arguments ask for, the deprecated keywords included."""
    unknown = sorted(set(deprecated) - set(_DEPRECATED) - set(_DEPRECATED_SPEC) - {"sync_batchnorm"})
    if unknown:
        raise TypeError(f"LNPlacement() got an unexpected keyword argument {unknown[0]!r}")
    if "sync_batchnorm" in deprecated:
        sync = deprecated.pop("sync_batchnorm")
        if not isinstance(sync, bool):
            raise TypeError(f"LNPlacement: sync_batchnorm must be True or False, got {sync!r}.")
        warnings.warn("LNPlacement: the sync_batchnorm keyword is deprecated and removed in the next release; pass "
                      "layer_sync=lightning.pytorch.plugins.TorchSyncBatchNorm() instead (the same plugin).",
                      LNLightningDeprecationWarning, stacklevel=3)
        if sync:
            if layer_sync is not None:
                raise ValueError("LNPlacement: pass sync_batchnorm=True or layer_sync=..., not both (Lightning runs one LayerSync).")
            layer_sync = TorchSyncBatchNorm()
    fields = {k: deprecated.pop(k) for k in _DEPRECATED_SPEC if k in deprecated}
    transition = transition_spec(transition, deprecated)
    try:
        if fields:
            if isinstance(placement, PlacementSpec):
                raise ValueError(f"LNPlacement: {', '.join(fields)} given beside a PlacementSpec, which holds them; set "
                                 "them in the PlacementSpec")
            spell = ", ".join([repr(placement)] + [f"{k}={v!r}" for k, v in fields.items()])
            words = "keyword is" if len(fields) == 1 else "keywords are"
            warnings.warn(f"LNPlacement: the {', '.join(fields)} {words} deprecated and removed in the next release; pass "
                          f"LNPlacement(PlacementSpec({spell}), ...) instead (from ln_lightning import PlacementSpec).",
                          LNLightningDeprecationWarning, stacklevel=3)
            if not isinstance(placement, str):
                raise TypeError(f"LNPlacement: placement must be a placement's name or a PlacementSpec, got "
                                f"{type(placement).__name__}.")
            placement = PlacementSpec(placement, **fields)
        return coerce_placement(placement, transition), layer_sync
    except PlacementError as err:  # one set of rules, the spec's, so the plugin accepts exactly what convert() does
        raise PlacementError(f"LNPlacement: {err}") from None


def transition_spec(transition: Any, deprecated: dict) -> TransitionSpec | None:
    """The TransitionSpec that `transition=` or the deprecated ``transition_*`` keywords ask for."""
    if deprecated.get("transition_steps", 0) is None:  # transition_steps=None, the old default: no transition
        del deprecated["transition_steps"]
    if not deprecated:
        return TransitionSpec.coerce(transition)
    if transition is not None:
        raise ValueError(f"LNPlacement: pass transition=TransitionSpec(...) or the deprecated {', '.join(sorted(deprecated))}, "
                         "not both.")
    fields = {_DEPRECATED[k]: v for k, v in deprecated.items()}
    new = ", ".join([f"{f}={v!r}" for f, v in fields.items()] + ["tolerance=None"])
    warnings.warn(f"LNPlacement: {', '.join(sorted(deprecated))} are deprecated and go in the next release; pass "
                  f"transition=TransitionSpec({new}) instead (tolerance=None keeps the open-loop schedule these keywords "
                  "had; TransitionSpec's default is the closed loop).",
                  LNLightningDeprecationWarning, stacklevel=4)
    if fields.get("steps") is None:
        raise ValueError(f"LNPlacement: {', '.join(sorted(deprecated))} apply only with transition_steps, which is "
                         "missing (they were silently ignored before). Pass transition=TransitionSpec(steps=N, ...).")
    try:
        return TransitionSpec(tolerance=None, **fields)
    except (TypeError, ValueError) as err:
        raise ValueError(f"LNPlacement: {err} (from the deprecated {', '.join(sorted(deprecated))}).") from None
