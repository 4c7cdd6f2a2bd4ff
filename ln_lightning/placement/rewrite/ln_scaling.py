"""LayerNorm Scaling (`norm_scale="depth"`): block `l`'s pre-norm outputs times `1/sqrt(l)`.

LayerNorm Scaling (Sun et al., "The Curse of Depth in Large Language Models", NeurIPS 2025)
multiplies the output of each pre-norm block's norms by `1/sqrt(l)`, `l` the block's 1-based depth in its stack:
`x <- x + F(LN(x) / sqrt(l))`. In a pre-norm stack the stream's variance grows with depth, so the deep blocks'
Jacobians approach the identity and they learn little; the scale holds that growth back (5-8% lower perplexity
from 130M to 7B parameters, in the paper, trained from scratch).

It is a training-dynamics choice, not a rewrite that keeps the function: on a trained model the deep blocks'
branches read inputs `sqrt(l)` times smaller than they were trained on. `convert` reports it as a change of the
function (with a note saying why), and it takes no transition (which promises the trained function at its start).

Spelled ``norm_scale="depth"``, not a value of ``branch_scale``: ``branch_scale`` multiplies a branch's *output*
(``x + c F(LN(x))``, and ``branch_scale="depth"`` is the one constant ``c = 1/sqrt(2L)`` for every block), where
LayerNorm Scaling multiplies the branch's *input* (``x + F(LN(x) / sqrt(l))``), by a factor that falls with each
block's depth. Through a non-linear branch the two are different functions, and they can't share a name.

How: a forward hook on each norm a block reads its branches through (`ScaleNormOutput`) multiplies the norm's
output by a constant (`BranchScale`, a non-persistent buffer: the configuration gives its value). On a norm
`convert` moved to the branch input (a deferred norm) the hook fires where it really normalises, at the branch
entries; on a norm called in the block's own forward (GPT-2's `ln_1`, torch's `norm1` with norm_first), where it
is called. It goes on every block that is pre-norm after the rewrite: those `convert` makes pre-norm and those
pre-norm already (unlike a branch scale, which needs the norm moved). Checked on the probe: the block's output equals that of a copy whose norms' gain and bias are multiplied by `1/sqrt(l)` instead
(`LN(x) s = (w s) x_hat + b s`), with no scale anywhere else.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.checking.checks import CheckFailed, relative_error
from ln_lightning.placement.reading.discovery import eval_no_grad
from ln_lightning.placement.rewrite.sublayer_plan import Unrecognised
from ln_lightning.placement.rewrite.scale import BranchScale

NORM_SCALES = ("depth",)
# On a block with LayerNorm Scaling: [(norm path inside the block, the scale's child name)], what undoing it removes.
ATTR = "_ln_lightning_norm_scale"


def depth_norm_scale(index: int) -> float:
    """LayerNorm Scaling's factor for the block at 1-based depth `index` in its stack: 1/sqrt(l)."""
    return 1.0 / math.sqrt(index)


class ScaleNormOutput:
    """Forward hook on a norm: its output times `scale` (a module). Off under `hooks.bypass()` (the model as
    written has no such scale)."""

    def __init__(self, scale: nn.Module):
        self.scale = scale

    def __call__(self, module, args, output):
        if hooks.bypassed():
            return None
        return self.scale(output)


def _hook_dicts(norm: nn.Module) -> list:
    """The dicts a norm's forward hooks are in: its own, and a deferred norm's normalisation's."""
    return [d for d in (norm._forward_hooks, norm.__dict__.get("_ln_post_hooks")) if d is not None]


def _norms(h) -> list[tuple[str, nn.Module]]:
    """(path inside the block, norm) of the norms the block's branches read through, once each."""
    seen, out = set(), []
    block_paths = {id(m): p for p, m in h.block.named_modules()}
    for norm in h.norms():
        if id(norm) not in seen:
            seen.add(id(norm))
            out.append((block_paths[id(norm)], norm))
    return out


def apply(h, index: int, fresh, tol: float) -> list[str]:
    """Give the pre-norm block `h`, at 1-based depth `index`, LayerNorm Scaling, and check it. Returns the paths
    added (the scales). Raises Unrecognised (can't) or CheckFailed; the caller restores the block (a Snapshot)."""
    value = depth_norm_scale(index)
    norms = _norms(h)
    for path, norm in norms:
        w, b = getattr(norm, "weight", None), getattr(norm, "bias", None)
        if not isinstance(w, torch.Tensor):
            raise Unrecognised(f"its norm {path} has no gain to check LayerNorm Scaling against (elementwise_affine=False)")
    added, record = [], []
    for path, norm in norms:
        name = path.replace(".", "_") + "_norm_scale"
        if hasattr(h.block, name):
            raise Unrecognised(f"block already has an attribute {name!r}; cannot add the LayerNorm Scaling scale there")
        w = norm.weight
        scale = BranchScale(value, device=w.device, dtype=w.dtype)
        h.block.add_module(name, scale)
        norm.register_forward_hook(ScaleNormOutput(scale))
        record.append((path, name))
        added.append(f"{h.path}.{name}" if h.path else name)
    h.block.__dict__[ATTR] = record
    _check(h, value, fresh, tol)
    return added


def _check(h, value: float, fresh, tol: float) -> None:
    """The block's output against a copy with the scales off and its norms' gain and bias times `value`."""
    reference = copy.deepcopy(h.block)
    for path, name in reference.__dict__.pop(ATTR):
        norm = reference.get_submodule(path)
        for d in _hook_dicts(norm):
            for k in [k for k, hook in d.items() if isinstance(hook, ScaleNormOutput)]:
                del d[k]
        with torch.no_grad():
            norm.weight.mul_(value)
            if getattr(norm, "bias", None) is not None:
                norm.bias.mul_(value)
    args, kwargs = fresh()
    with eval_no_grad(h.block):
        got = h.block(*args, **kwargs)
    args, kwargs = fresh()
    with eval_no_grad(reference):
        want = reference(*args, **kwargs)
    got, want = (t if isinstance(t, torch.Tensor) else hooks.stream_of(t) for t in (got, want))
    err = relative_error(got, want)
    if not err <= tol:
        raise CheckFailed(f"with LayerNorm Scaling its output differs by {err:.2e} (relative; tolerance {tol:.0e}) from the "
                          "same block with its norms' gains scaled instead")


def undo(h) -> list[str]:
    """Remove the block's LayerNorm Scaling (hooks and scales). Returns the paths removed."""
    removed = []
    for path, name in h.block.__dict__.pop(ATTR, []):
        norm = h.block.get_submodule(path)
        for d in _hook_dicts(norm):
            for k in [k for k, hook in d.items() if isinstance(hook, ScaleNormOutput)]:
                del d[k]
        if name in h.block._modules:
            del h.block._modules[name]
            removed.append(f"{h.path}.{name}" if h.path else name)
    return removed


def has_norm_scale(block: nn.Module) -> bool:
    return ATTR in block.__dict__


def scaled_norms(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """Each (norm, scale) pair of LayerNorm Scaling in `model`: which norm's output which scale multiplies (export's
    plan reads them here, not from the blocks' tags)."""
    return [(block.get_submodule(path), getattr(block, name))
            for block in model.modules() for path, name in block.__dict__.get(ATTR, [])]


__all__ = ["ATTR", "NORM_SCALES", "ScaleNormOutput", "apply", "depth_norm_scale", "has_norm_scale", "scaled_norms", "undo"]
