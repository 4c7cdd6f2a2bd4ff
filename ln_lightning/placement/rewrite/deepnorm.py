"""DeepNorm on a trained post-norm model: `x <- LN(alpha * x + G'(x))`, alpha = (2N)^(1/4), G' = alpha * G.

DeepNorm (Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers") up-weights the residual of a
post-norm block by alpha = (2N)^(1/4) for a stack of N blocks. A trained post-norm block computes `LN(x + G(x))`;
its DeepNorm reparameterisation takes `G' = alpha * G` (the branch's last linear layer's weight and bias times
alpha), and since a LayerNorm is invariant to the scale of its input, `LN(alpha x + alpha G(x)) = LN(x + G(x))`:
the function is unchanged at the switch. What changes is the training from there: the branch's parameters now
write `alpha` times more than they did into a stream `alpha` times larger, so each optimizer step moves the
normalised sum `1/alpha` as far as before (DeepNet's bounded model update).

How it is computed here: the user's forward adds `x + b` and normalises it, and we don't rewrite that code, so
its residual can't be multiplied by alpha. The branch's output is multiplied by the constant `1/alpha` instead (a
`BranchScale` at the branch exit, as `branch_scale` puts one there), giving `LN_eps(x + G'(x) / alpha)`. That is
DeepNorm's sum divided by alpha; the norm module, its eps included, is untouched, so the sum `alpha x + G'(x)`
is normalised with eps * alpha^2 (a LayerNorm of `z / alpha` with eps is one of `z` with eps * alpha^2, exactly).
The function at the switch is then the trained one to rounding (two multiplications by alpha and 1/alpha), and
the difference from DeepNorm's formula with the norm's own eps is eps-sized (measured in
tests/test_deepnorm_ln_scaling.py).

Where it applies: every sublayer of a block computing post-norm as written, whose branch output is a linear
layer's output (possibly through a dropout): torch's Transformer layers (their attention's `out_proj`,
`linear2`) and hooked blocks, where the linear is found on the probe (the one whose output equals the branch
exit's). A block pre-norm as written has no exact post-norm form and is refused; a block ln_lightning rewrote
must be converted back to "post" first. The linear's weight and bias are replaced by scaled copies (new
Parameters, as `convert` never writes a tensor in place): build the optimizer after converting, as LNPlacement does.
"""

from __future__ import annotations

import torch
from torch import nn

from ln_lightning.placement.rewrite import hooks
from ln_lightning.placement.reading.blocks import _DEEPNORM, TorchLayerHandler
from ln_lightning.placement.checking.checks import CheckFailed, relative_error
from ln_lightning.placement.reading.discovery import eval_no_grad
from ln_lightning.placement.rewrite.sublayer_plan import Unrecognised
from ln_lightning.placement.rewrite.scale import BranchScale

# On a block DeepNorm rewrote: [(linear path inside the block, alpha)], what undoing it divides back.
ATTR = _DEEPNORM


class DeepNormScale(hooks.ScaleBranchOutput):
    """The branch exit's `1/alpha`, on also under `hooks.bypass()`: with alpha folded into the weights, the bypassed
    model (what ln_lightning measures as "the function as written") is the reparameterised one only with it."""

    def __call__(self, module, args, output):
        if self.scale is None or not hooks._is_this_branch(self, args):
            return None
        value = output if self.index is None else output[self.index]
        return hooks._with_branch_value(output, self.index, self.scaled(value))


def deepnorm_alpha(depth: int) -> float:
    """DeepNorm's residual weight for a stack of `depth` blocks (Wang et al. 2022, encoder-only form): (2N)^(1/4)."""
    return (2.0 * depth) ** 0.25


def is_deepnorm(block: nn.Module) -> bool:
    return ATTR in block.__dict__


def _torch_linears(h) -> list[tuple[str, str, str]]:
    """(sublayer name, its branch's last linear, the module its output leaves through) of a torch Transformer layer."""
    last = {"self_attn": "self_attn.out_proj", "cross_attn": "multihead_attn.out_proj", "ff": "linear2"}
    return [(name, last[name], drop) for name, _, drop in h.parts]


def _hooked_linears(h, fresh) -> list[tuple[str, str, str]]:
    """(sublayer name, its branch's last linear, the branch exit module) of a hooked block, read on the probe: the
    branch's last linear is the one nn.Linear, called once, whose output equals the exit's output."""
    outputs: dict[str, list[torch.Tensor]] = {}
    handles = []
    linears = {p: m for p, m in h.block.named_modules() if isinstance(m, nn.Linear)}
    exits = {s.plan.exit_module for s in h.subs if s.plan is not None and s.plan.exit_module is not None}
    for path in set(linears) | exits:
        def keep(mod, args, out, path=path):
            outputs.setdefault(path, []).append(out)
        handles.append(h.block.get_submodule(path).register_forward_hook(keep) if path else h.block.register_forward_hook(keep))
    try:
        args, kwargs = fresh()
        with eval_no_grad(h.block), hooks.bypass():
            h.block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    found = []
    for s in h.subs:
        p = s.plan
        if p is None or p.exit_module is None:
            raise Unrecognised(f"sublayer {s.name}: {getattr(p, 'exit_reason', '') or 'no branch exit module'}, so DeepNorm's "
                               "alpha has no linear layer to go into")
        calls = outputs.get(p.exit_module, [])
        number = p.exit_call.number if p.exit_call is not None else 0
        if len(calls) <= number or (p.exit_call is None and len(calls) != 1):
            raise Unrecognised(f"sublayer {s.name}: its branch exit {p.exit_module} ran {len(calls)} times on the probe")
        value = calls[number] if p.exit_index is None else calls[number][p.exit_index]
        same = [path for path, outs in outputs.items() if path in linears and len(outs) == 1 and isinstance(outs[0], torch.Tensor)
                and outs[0].shape == value.shape and torch.equal(outs[0], value)]
        if len(same) != 1:
            raise Unrecognised(
                f"sublayer {s.name}: its branch output (the output of {p.exit_module or 'the block'}) is "
                + ("not a linear layer's output" if not same else f"the output of several linear layers ({', '.join(same)})")
                + ", so DeepNorm's alpha can't be folded into a weight (G' = alpha * G)")
        found.append((s.name, same[0], p.exit_module))
    return found


def _scaled_parameter(p: nn.Parameter, alpha: float) -> nn.Parameter:
    with torch.no_grad():
        return nn.Parameter(p.detach() * alpha, requires_grad=p.requires_grad)


def _refuse_shared(h, root: nn.Module | None, linear: nn.Linear, path: str) -> None:
    if root is None:
        return
    mine = {id(t) for t in linear.parameters(recurse=False)}
    for name, t in root.named_parameters(remove_duplicate=False):
        if id(t) in mine and not name.startswith(f"{h.path}.{path}." if h.path else f"{path}."):
            raise Unrecognised(f"the weight of {path} is shared with {name}: scaling it by alpha would change that module too")


def _run(h, fresh, paths) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """The block's stream output on a fresh probe, and the outputs of the modules at `paths` in that forward."""
    got: dict[str, list[torch.Tensor]] = {p: [] for p in paths}
    # Prepended: a linear that is its branch's exit too (BART's fc2) carries the 1/alpha hook, which runs after.
    handles = [h.block.get_submodule(p).register_forward_hook(lambda m, a, o, p=p: got[p].append(o.detach()), prepend=True)
               for p in paths]
    try:
        args, kwargs = fresh()
        with eval_no_grad(h.block):
            out = h.block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return (out if isinstance(out, torch.Tensor) else hooks.stream_of(out)), got


def apply(h, alpha: float, fresh, y_before: torch.Tensor, tol: float, root: nn.Module | None = None) -> tuple[list[str], float]:
    """Rewrite the post-norm block `h` to DeepNorm with `alpha` and check it: its output on the probe against
    `y_before` (what it gave before), and each scaled linear's output against alpha times its output before (the
    fold took effect in the forward; torch's attention calls `out_proj`'s weights without calling the module, and its
    fold is checked through the output alone). Returns (the paths added: the branch scales, the output's relative
    error). Raises Unrecognised (it can't) or CheckFailed (the check failed); the caller restores the block."""
    torch_layer = isinstance(h, TorchLayerHandler)
    parts = _torch_linears(h) if torch_layer else _hooked_linears(h, fresh)
    paths = [path for _, path, _ in parts]
    _, before = _run(h, fresh, paths)
    added, folded = [], []
    for name, path, exit_path in parts:
        linear = h.block.get_submodule(path)
        _refuse_shared(h, root, linear, path)
        linear.weight = _scaled_parameter(linear.weight, alpha)
        if linear.bias is not None:
            linear.bias = _scaled_parameter(linear.bias, alpha)
        folded.append((path, alpha))
        w = linear.weight
        scale = BranchScale(1.0 / alpha, device=w.device, dtype=w.dtype)
        if torch_layer:
            added.append(h._add_scale(h._scale_name(name), scale))
            # A hook on the module also disables torch's eval fast path, which would skip the scale.
            h.block.get_submodule(exit_path).register_forward_hook(DeepNormScale(scale, None))
        else:
            s = next(x for x in h.subs if x.name == name)
            added.append(h._add(h._scale_name(s), scale))
            h._get(exit_path).register_forward_hook(DeepNormScale(scale, s.plan.exit_index, call=h._branch_call(s.plan)))
    h.block.__dict__[ATTR] = folded
    y, after = _run(h, fresh, paths)
    err = relative_error(y, y_before)
    if not err <= tol:
        raise CheckFailed(f"the DeepNorm form's output differs from the block's by {err:.2e} (relative; tolerance {tol:.0e})")
    for path in paths:
        if len(before[path]) != len(after[path]) or len(before[path]) > 1:
            raise CheckFailed(f"{path} ran {len(before[path])} times on the probe; DeepNorm folds alpha into a linear called once")
        for b, a in zip(before[path], after[path]):
            fold = relative_error(a, alpha * b)
            if not fold <= tol:
                raise CheckFailed(f"{path}'s output is not alpha times what it was (relative error {fold:.2e})")
    return added, err


def undo(h) -> list[str]:
    """Back to the plain post-norm block: the linears divided by alpha (new Parameters), the scales and their hooks
    removed. Returns the paths removed."""
    folded = h.block.__dict__.pop(ATTR, [])
    for path, alpha in folded:
        linear = h.block.get_submodule(path)
        linear.weight = _scaled_parameter(linear.weight, 1.0 / alpha)
        if linear.bias is not None:
            linear.bias = _scaled_parameter(linear.bias, 1.0 / alpha)
    return []


__all__ = ["ATTR", "DeepNormScale", "apply", "deepnorm_alpha", "is_deepnorm", "undo"]
