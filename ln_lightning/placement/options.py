"""The options of `convert` and `LNPlacement`, checked in one place so the two can't disagree."""

from __future__ import annotations

import math

from ln_lightning.placement.errors import PlacementError

PLACEMENTS = ("pre", "post")
BRANCH_SCALES = "None, a positive float c, 'depth' (c = 1/sqrt(2L)) or 'layerscale'"


def _validate(placement, final_norm, branch_scale, strict, layerscale_init) -> None:
    if placement not in PLACEMENTS:
        raise PlacementError(f"unknown placement {placement!r}; valid placements are 'pre' (x + F(LN(x))) and 'post' (LN(x + F(x)))")
    if not isinstance(final_norm, bool):
        raise PlacementError(f"final_norm must be True or False, got {final_norm!r}")
    if not isinstance(strict, bool):
        raise PlacementError(f"strict must be True or False, got {strict!r}")
    if branch_scale is not None:
        if isinstance(branch_scale, str):
            if branch_scale not in ("depth", "layerscale"):
                raise PlacementError(f"unknown branch_scale {branch_scale!r}; valid values are {BRANCH_SCALES}")
        elif isinstance(branch_scale, bool) or not isinstance(branch_scale, (int, float)) or not math.isfinite(branch_scale) or branch_scale <= 0:
            raise PlacementError(f"branch_scale={branch_scale!r} is not valid; valid values are {BRANCH_SCALES}")
        if placement == "post":
            raise PlacementError("branch_scale applies to pre-norm branches (x + c*F(LN(x))); use branch_scale=None with placement='post'")
    if layerscale_init is not None:
        if branch_scale != "layerscale":
            raise PlacementError("layerscale_init is only used with branch_scale='layerscale'")
        if isinstance(layerscale_init, bool) or not isinstance(layerscale_init, (int, float)) or not math.isfinite(layerscale_init) or layerscale_init <= 0:
            raise PlacementError(f"layerscale_init must be a positive finite float, got layerscale_init={layerscale_init!r}")


def validate_options(placement="pre", *, final_norm=True, branch_scale=None, strict=False, layerscale_init=None) -> None:
    """Raise PlacementError for options `convert` would reject (used by LNPlacement at construction)."""
    _validate(placement, final_norm, branch_scale, strict, layerscale_init)
