"""Whether a model already rewritten computes the function a request for a rewrite would give it.

A model rewritten before (by ``convert``, an earlier ``LNPlacement`` or a load) meets a request (``LNPlacement``'s
options): two configurations can spell the same function (``branch_scale=1.0`` and None; ``"depth"`` and its
float on a stack of that depth; an explicit ``mix_post_blocks`` equal to the default quarter; ``final_norm``
where every stack already has one), and a request for another function must be refused, not silently trained
as the first. :func:`difference` says why two differ, or None.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ln_lightning.placement.engine import inspect_model
from ln_lightning.placement.options import mix_split


def _rewritten_stacks(model: nn.Module, placement: str) -> list:
    """The stacks a rewrite to `placement` changed: those with a block of that placement ("mix": pre)."""
    block_placement = "pre" if placement == "mix" else placement
    return [s for s in inspect_model(model).stacks if any(b.placement == block_placement for b in s.blocks)]


def _scale_per_stack(config: dict, depths: list[int]) -> list[Any]:
    """What each stack's branches are multiplied by under `config` (None and 1.0 are the same function)."""
    bs = config.get("branch_scale")
    if bs == "depth":
        return [1.0 / math.sqrt(2 * d) for d in depths]
    if bs is None:
        return [1.0] * len(depths)
    return [float(bs) if isinstance(bs, (int, float)) else bs] * len(depths)


def difference(existing: dict, request: dict, model: nn.Module, added: list[str] | None) -> str | None:
    """Why a model rewritten to `existing` computes another function than `request` would give it; None if it doesn't."""
    if existing.get("placement") != request["placement"]:
        return f"placement {existing.get('placement')!r} is not {request['placement']!r}"
    placement = request["placement"]
    if existing.get("norm_scale") != request.get("norm_scale"):  # LayerNorm Scaling: None is no scale
        return f"norm_scale {existing.get('norm_scale')!r} is not {request.get('norm_scale')!r}"
    if placement in ("post", "deepnorm"):
        return None  # "post" and "deepnorm" take no other option that changes the function
    if placement == "mix" and existing.get("mix_post_blocks") != request.get("mix_post_blocks"):
        # None is a quarter of each stack: an explicit count equal to that on every stack is the same function.
        depths = [s.depth for s in inspect_model(model).stacks]
        if [mix_split("mix", d, existing.get("mix_post_blocks")) for d in depths] != [mix_split("mix", d, request.get("mix_post_blocks")) for d in depths]:
            return (f"mix_post_blocks {existing.get('mix_post_blocks')!r} is not {request.get('mix_post_blocks')!r} "
                    "(None: a quarter of each stack)")
    stacks = None
    if existing.get("branch_scale") != request["branch_scale"]:
        stacks = _rewritten_stacks(model, placement)
        depths = [s.depth for s in stacks]
        have, want = _scale_per_stack(existing, depths), _scale_per_stack(request, depths)
        same = all(
            (math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) and isinstance(b, float) else a == b)
            for a, b in zip(have, want)
        )
        if not same:
            return f"branch_scale {existing.get('branch_scale')!r} is not {request['branch_scale']!r}"
    if request["branch_scale"] == "layerscale" and existing.get("layerscale_init") != request.get("layerscale_init"):
        return (f"layerscale_init {existing.get('layerscale_init', 'unknown')!r} is not {request.get('layerscale_init')!r} "
                "(the scales started from other values)")
    if bool(existing.get("final_norm")) != request["final_norm"]:
        stacks = stacks if stacks is not None else _rewritten_stacks(model, placement)
        finals = [s.final_norm for s in stacks]
        if request["final_norm"]:  # the request adds a final norm wherever a stack has none
            if any(f is None for f in finals):
                return "final_norm=False left a stack without a final norm; final_norm=True would add one"
        elif added is None or any(f in added for f in finals):  # unknown, or the rewrite added one
            return "final_norm=True added a final norm that final_norm=False would not have"
    return None


__all__ = ["difference"]
