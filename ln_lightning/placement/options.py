"""The options of `convert` and `LNPlacement`, checked in one place so the two can't disagree."""

from __future__ import annotations

import math

from ln_lightning.placement.errors import PlacementError

PLACEMENTS = ("pre", "post", "peri", "output", "mix", "deepnorm")
_PLACEMENT_HELP = (
    "'pre' (x + F(N(x))), 'post' (N(x + F(x))), 'peri' (x + N_out(F(N(x))), Peri-LN / Gemma's sandwich), "
    "'output' (x + N(F(x)), OLMo 2), 'mix' (Mix-LN: the first mix_post_blocks blocks of each stack post, the rest pre) "
    "and 'deepnorm' (DeepNorm: N(alpha*x + G(x)), alpha = (2N)^(1/4), exact from a post-norm model)"
)
BRANCH_SCALES = ("None, a positive float c, 'depth' (c = 1/sqrt(2L)), 'layerscale' or 'stream' (per-branch constants a "
                 "transition measures from the trained model)")


def validate_options(placement="pre", *, final_norm=True, branch_scale=None, strict=False, layerscale_init=None, mix_post_blocks=None,
                     norm_scale=None) -> None:
    """Raise PlacementError for options `convert` would reject (convert, and LNPlacement at construction)."""
    if placement not in PLACEMENTS:
        raise PlacementError(f"unknown placement {placement!r}; valid placements are {_PLACEMENT_HELP}")
    if mix_post_blocks is not None:
        if placement != "mix":
            raise PlacementError(f"mix_post_blocks is only used with placement='mix', got placement={placement!r}")
        if isinstance(mix_post_blocks, bool) or not isinstance(mix_post_blocks, int) or mix_post_blocks < 0:
            raise PlacementError(f"mix_post_blocks must be a non-negative int (how many leading blocks stay post-norm), got {mix_post_blocks!r}")
    if not isinstance(final_norm, bool):
        raise PlacementError(f"final_norm must be True or False, got {final_norm!r}")
    if not isinstance(strict, bool):
        raise PlacementError(f"strict must be True or False, got {strict!r}")
    if branch_scale is not None:
        if isinstance(branch_scale, str):
            if branch_scale not in ("depth", "layerscale", "stream"):
                raise PlacementError(f"unknown branch_scale {branch_scale!r}; valid values are {BRANCH_SCALES}")
        elif isinstance(branch_scale, bool) or not isinstance(branch_scale, (int, float)) or not math.isfinite(branch_scale) or branch_scale <= 0:
            raise PlacementError(f"branch_scale={branch_scale!r} is not valid; valid values are {BRANCH_SCALES}")
        if placement not in ("pre", "mix") and not (placement in ("peri", "output") and branch_scale == "stream"):
            raise PlacementError(
                f"branch_scale applies to pre-norm branches (x + c*F(LN(x))), with placement 'pre' or 'mix' (and "
                f"'stream', a transition's measured scales, with 'peri' and 'output' too); use branch_scale=None with "
                f"placement={placement!r}"
            )
    if norm_scale is not None:
        if norm_scale != "depth":
            raise PlacementError(f"unknown norm_scale {norm_scale!r}; valid values are None and 'depth' (LayerNorm Scaling: "
                                 "block l's norm outputs times 1/sqrt(l))")
        if placement not in ("pre", "mix"):
            raise PlacementError(
                f"norm_scale='depth' (LayerNorm Scaling) scales the norm a pre-norm branch reads (x + F(LN(x)/sqrt(l))), "
                f"with placement 'pre' or 'mix'; use one of those, or drop norm_scale with placement={placement!r}")
        if branch_scale == "depth":
            raise PlacementError(
                "norm_scale='depth' (LayerNorm Scaling: 1/sqrt(l) on block l's norm outputs) and branch_scale='depth' "
                "(c = 1/sqrt(2L) on every branch output) are two depth scalings of the same branches: drop branch_scale "
                "(or norm_scale)")
        if branch_scale == "stream":
            raise PlacementError(
                "norm_scale='depth' (LayerNorm Scaling) changes the trained function, and branch_scale='stream' is the end "
                "point of a transition that keeps it: drop branch_scale (and convert without a transition)")
    if layerscale_init is not None:
        if branch_scale != "layerscale":
            raise PlacementError("layerscale_init is only used with branch_scale='layerscale'")
        if isinstance(layerscale_init, bool) or not isinstance(layerscale_init, (int, float)) or not math.isfinite(layerscale_init) or layerscale_init <= 0:
            raise PlacementError(f"layerscale_init must be a positive finite float, got layerscale_init={layerscale_init!r}")


def mix_split(placement: str, depth: int, mix_post_blocks: int | None) -> list[str]:
    """The placement each block of a stack of `depth` blocks gets. 'mix': Mix-LN (Li et al. 2025) keeps
    the first quarter post-norm (by default) for the deep layers' gradients, and the rest pre-norm."""
    if placement != "mix":
        return [placement] * depth
    k = depth // 4 if mix_post_blocks is None else min(mix_post_blocks, depth)
    return ["post"] * k + ["pre"] * (depth - k)


# The placements a transition can end at (a function-preserving blend from the model as written).
TARGETS = ("pre", "peri", "output", "mix")


def check_target(placement: str) -> None:
    """Raise unless a transition can end at `placement` (LNPlacement calls this at construction)."""
    if placement == "post":
        raise PlacementError(
            "a transition to placement='post' can't preserve the function: ln_lightning converts to post-norm "
            "only by undoing its own rewrite, which has no trained function to keep. Use placement 'pre', 'peri', "
            "'output' or 'mix', or drop the transition"
        )
    if placement == "deepnorm":
        raise PlacementError(
            "placement='deepnorm' needs no transition: rewriting a post-norm model to DeepNorm is exact at the switch "
            "(alpha goes into the branches' weights, the norm's scale invariance keeps the function). Drop the transition"
        )
    if placement not in TARGETS:
        raise PlacementError(f"a transition ends at one of {', '.join(map(repr, TARGETS))}, not {placement!r}")
