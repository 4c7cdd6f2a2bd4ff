"""A function-preserving transition from post-norm to pre-norm, for a model that is already trained.

`convert(model, "pre")` changes what a trained post-norm model computes (by 27% on the demo LM). The
transition instead blends the two placements with one number `a` in [0, 1], per converted sublayer
with norm `LN` and branch `F` (branch scale `c`, 1 without one):

    u = (1-a)*x + a*LN(x)                 at the branch's entries
    h = x + ((1-a) + a*c) * F(u)          (the branch scale ramps from 1 to c)
    out = (1-a)*LN(h) + a*h               at the norm's own call site

and a final norm that `convert` added outputs `(1-a)*s + a*LN_f(s)`. At `a = 0` every term is exact
(`1*x + 0*y == x` in floating point), so the model computes bit-for-bit the post-norm function it was
trained with (and an added final norm is the identity); at `a = 1` it computes exactly what
`convert(model, "pre")` gives. `finish(model)` then removes every piece of the machinery, leaving the
model exactly as `convert(model, "pre")` left it (fused torch layers included), at plain pre-norm speed.

Usage without a Trainer::

    from ln_lightning.placement import transition
    report = transition.begin(model, final_norm=True)      # convert(model, "pre", ...) at a = 0
    for step in range(n):
        transition.set_blend(model, transition.schedule((step + 1) / n))
        ...train...
    transition.finish(model)                               # plain pre-norm from here on

With a Trainer: `LNPlacement("pre", transition_steps=N, transition_schedule="linear"|"cosine")`.

State: the blend is a persistent buffer `ln_lightning_transition.blend` on the root module (and the
step the schedule started at, `ln_lightning_transition.start_step`), so a checkpoint written
mid-transition resumes at the same point and `load_converted` restores it.

The pieces, all undone by `finish`:

* a converted block's deferred norm gets the instance attribute `ln_lightning_transition` (consulted
  by `hooks.DeferredNorm.forward`: the one edit this needs in hooks.py);
* its entry / exit hooks switch class to the blend-aware subclasses below (same attributes);
* a torch `nn.TransformerEncoderLayer`/`DecoderLayer` switches class to `BlendEncoderLayer` /
  `BlendDecoderLayer` (its previous class is remembered);
* an added final norm gets a forward hook `BlendFinalNorm`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ln_lightning.placement import hooks
from ln_lightning.placement.errors import PlacementError

ATTR = "ln_lightning_transition"  # the root's submodule, and the deferred norms' instance attribute
_PREV_CLASS = "_ln_lightning_pre_transition_class"
SCHEDULES = ("linear", "cosine")


def schedule(t: float, kind: str = "linear") -> float:
    """The blend at fraction `t` of the transition: linear `t`, or cosine `(1 - cos(pi t)) / 2`.

    Both are exactly 0 at t <= 0 and exactly 1 at t >= 1.
    """
    if kind not in SCHEDULES:
        raise PlacementError(f"unknown transition_schedule {kind!r}; valid schedules are {', '.join(map(repr, SCHEDULES))}")
    if t <= 0:
        return 0.0
    if t >= 1:
        return 1.0
    return t if kind == "linear" else 0.5 * (1.0 - math.cos(math.pi * t))


class Transition(nn.Module):
    """Holds the blend (persistent buffers, so it is in every state_dict and checkpoint)."""

    def __init__(self, steps: int | None = None, kind: str = "linear", device=None):
        super().__init__()
        self.steps = steps
        self.kind = kind
        self.register_buffer("blend", torch.zeros((), dtype=torch.float32, device=device), persistent=True)
        # The optimizer step the schedule started at (-1: not yet); a resumed run continues from it.
        self.register_buffer("start_step", torch.full((), -1, dtype=torch.int64, device=device), persistent=True)
        # The schedule itself (steps, index in SCHEDULES; -1: none), so a resume with another one is caught.
        self.register_buffer("schedule", torch.tensor([steps or -1, SCHEDULES.index(kind)], dtype=torch.int64, device=device),
                             persistent=True)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if self.__dict__.get("_source_finished"):
            return  # the state_dict comes from the model after its transition: finish() follows the load
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def a(self, like: torch.Tensor) -> torch.Tensor:
        # A 0-dim tensor: no host sync, and a bf16 stream stays bf16.
        return self.blend.to(like.dtype)

    def extra_repr(self) -> str:
        return f"blend={float(self.blend):.4g}, steps={self.steps}, schedule={self.kind!r}"

    # Called by hooks.DeferredNorm.forward at a deferred norm's call site (y = LN(h) computed there).
    def call_site(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = self.a(h)
        return (1 - a) * y + a * h


def _mix(t: Transition, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(1-a)*x + a*y for the transition `t`."""
    a = t.a(x)
    return (1 - a) * x + a * y


class BlendNormalizeBranchInput(hooks.NormalizeBranchInput):
    """Entry hook during the transition: the branch reads `(1-a)*x + a*LN(x)`."""

    def _normalized(self, t: torch.Tensor) -> torch.Tensor:
        return _mix(self.transition, t, self.norm.normalize(t))


class BlendScaleBranchOutput(hooks.ScaleBranchOutput):
    """Exit hook during the transition: the branch output times `(1-a) + a*c` (1 -> c)."""

    def __call__(self, module, args, output):
        if hooks._bypassed() or self.scale is None:
            return None
        value = output if self.index is None else output[self.index]
        value = _mix(self.transition, value, self.scale(value))
        if self.index is None:
            return value
        out = list(output)
        out[self.index] = value
        return type(output)(out) if isinstance(output, tuple) else out


class BlendFinalNorm:
    """Forward hook on a final norm convert added: `(1-a)*s + a*LN_f(s)` (the identity at a = 0)."""

    def __init__(self, transition: Transition):
        self.transition = transition

    def __call__(self, module, args, output):
        if hooks._bypassed():
            return None
        return _mix(self.transition, args[0], output)


def _blend_sublayer(t: Transition, x, norm, branch):
    a = t.a(x)
    u = (1 - a) * x + a * norm(x)
    h = x + branch(u)  # the branch scale (a hook on its dropout) is the blend-aware one
    return (1 - a) * norm(h) + a * h


class BlendEncoderLayer(nn.TransformerEncoderLayer):
    """`nn.TransformerEncoderLayer` during the transition: each sublayer blended as in the module doc."""

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        t = self.__dict__[ATTR]
        # The same mask canonicalisation as torch's forward.
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask", other_type=F._none_or_dtype(src_mask),
            other_name="src_mask", target_type=src.dtype,
        )
        src_mask = F._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None, other_name="", target_type=src.dtype, check_other=False)
        x = _blend_sublayer(t, src, self.norm1, lambda u: self._sa_block(u, src_mask, src_key_padding_mask, is_causal=is_causal))
        return _blend_sublayer(t, x, self.norm2, self._ff_block)


class BlendDecoderLayer(nn.TransformerDecoderLayer):
    """`nn.TransformerDecoderLayer` during the transition."""

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        t = self.__dict__[ATTR]
        x = _blend_sublayer(t, tgt, self.norm1, lambda u: self._sa_block(u, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = _blend_sublayer(t, x, self.norm2, lambda u: self._mha_block(u, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
        return _blend_sublayer(t, x, self.norm3, self._ff_block)


def _torch_layer_classes():
    from ln_lightning.placement.fused_layers import FUSED_CLASS

    enc = (nn.TransformerEncoderLayer, FUSED_CLASS[nn.TransformerEncoderLayer])
    dec = (nn.TransformerDecoderLayer, FUSED_CLASS[nn.TransformerDecoderLayer])
    return enc, dec


class _SourceFinishedCheck:
    """load_state_dict pre-hook on the root: a state_dict of the *rewritten* model (it holds the placement
    marker) without the transition's buffers was written after that model's transition ended (ddp_spawn's
    rank 0 sends such weights back to the main process): this model then finishes too, after the load,
    instead of silently keeping its own blend with those weights."""

    def __call__(self, module, state_dict, prefix, *args):
        t = active(module)
        if t is None:
            return
        from ln_lightning.rewrite_record import MARKER

        mine = prefix + ATTR + "."
        if not any(k.startswith(mine) for k in state_dict) and any(k.rpartition(".")[2] == MARKER for k in state_dict):
            t.__dict__["_source_finished"] = True


class _FinishAfterLoad:
    def __call__(self, module, incompatible_keys):
        t = active(module)
        if t is not None and t.__dict__.pop("_source_finished", False):
            finish(module)


_LOAD_HOOKS = (_SourceFinishedCheck, _FinishAfterLoad)


def _our_load_hook(h) -> bool:
    return isinstance(h, _LOAD_HOOKS) or isinstance(getattr(h, "hook", None), _LOAD_HOOKS)


# ---------------------------------------------------------------------------------------------- API
def active(model: nn.Module) -> Transition | None:
    """The model's transition module while a transition is under way, else None."""
    t = model._modules.get(ATTR)
    return t if isinstance(t, Transition) else None


def get_blend(model: nn.Module) -> float | None:
    t = active(model)
    return None if t is None else float(t.blend)


def set_blend(model: nn.Module, a: float) -> None:
    """Set the blend: 0 is the post-norm function the model was trained with, 1 is `convert(model, "pre")`."""
    t = active(model)
    if t is None:
        raise PlacementError("set_blend: the model is not in a transition; start one with ln_lightning.placement.transition.begin(model)")
    a = float(a)
    if not (0.0 <= a <= 1.0):
        raise PlacementError(f"set_blend: the blend must be in [0, 1], got {a!r}")
    t.blend.fill_(a)


def begin(model: nn.Module, *, steps: int | None = None, schedule_kind: str = "linear", **convert_options: Any):
    """`convert(model, "pre", **convert_options)`, then the transition at a = 0 (the model's own function).

    Returns the ConversionReport. Set the blend with `set_blend`, end with `finish`.
    """
    from ln_lightning.placement.engine import convert

    if convert_options.get("placement", "pre") != "pre":
        raise PlacementError("a transition goes from post-norm to pre-norm: placement must be 'pre'")
    convert_options.pop("placement", None)
    report = convert(model, "pre", **convert_options)
    start(model, report, steps=steps, schedule_kind=schedule_kind)
    return report


def start(model: nn.Module, report, *, steps: int | None = None, schedule_kind: str = "linear") -> Transition:
    """Switch a model `convert(model, "pre")` just rewrote (with `report`) into the transition at a = 0.

    Only what that conversion changed is blended (blocks it converted, final norms it added); blocks
    that were pre-norm already keep computing what they did.
    """
    if active(model) is not None:
        raise PlacementError("the model is already in a transition; finish it first (transition.finish(model))")
    if report is None or report.placement != "pre":
        raise PlacementError(
            "a transition starts from the report of the conversion to pre-norm that rewrote the model "
            "(transition.begin(model) does both); a model rewritten earlier can't tell which blocks were post-norm"
        )
    if ATTR in model._modules or hasattr(model, ATTR):
        raise PlacementError(f"{type(model).__name__} already has an attribute {ATTR!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise PlacementError(f"transition_steps must be a positive int, got {steps!r}")
    schedule(0.0, schedule_kind)  # validates the name
    enc, dec = _torch_layer_classes()
    blocks = [model.get_submodule(b.path) if b.path else model for b in report.converted]
    # Check everything before changing anything.
    for b, block in zip(report.converted, blocks):
        if isinstance(block, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) and type(block) not in enc + dec:
            raise PlacementError(
                f"transition_steps can't blend {b.path} ({type(block).__name__}): it subclasses a torch Transformer layer "
                "with its own forward, which the transition would replace. Convert it without transition_steps."
            )
    ref = next(iter(model.parameters()), None)
    if ref is None:
        ref = next(iter(model.buffers()), None)
    t = Transition(steps, schedule_kind, device=ref.device if ref is not None and ref.device.type != "meta" else None)
    for block in blocks:
        if type(block) in enc + dec:
            block.__dict__[_PREV_CLASS] = type(block)
            block.__dict__[ATTR] = t
            block.__class__ = BlendEncoderLayer if type(block) in enc else BlendDecoderLayer
        for m in block.modules():
            if hooks.is_deferred(m):
                m.__dict__[ATTR] = t
            for d in (m._forward_pre_hooks, m._forward_hooks):
                for h in d.values():
                    if type(h) is hooks.NormalizeBranchInput:
                        h.__class__, h.transition = BlendNormalizeBranchInput, t
                    elif type(h) is hooks.ScaleBranchOutput:
                        h.__class__, h.transition = BlendScaleBranchOutput, t
    from ln_lightning.placement.norms import norm_types

    for path in report.added:
        try:
            m = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(m, norm_types()):  # a final norm (branch scales are handled at their hooks)
            m.register_forward_hook(BlendFinalNorm(t))
    model.add_module(ATTR, t)
    model.register_load_state_dict_pre_hook(_SourceFinishedCheck())
    model.register_load_state_dict_post_hook(_FinishAfterLoad())
    return t


def finish(model: nn.Module) -> None:
    """End the transition: the model is exactly what `convert(model, "pre")` made it, with no blend left.

    Raises if any piece of the machinery would stay behind (it would be a silent change of function).
    """
    t = active(model)
    if t is None:
        raise PlacementError("finish: the model is not in a transition")
    for m in model.modules():
        if m.__dict__.get(ATTR) is t:
            del m.__dict__[ATTR]
        prev = m.__dict__.pop(_PREV_CLASS, None)
        if prev is not None:
            m.__class__ = prev
        for d in (m._forward_pre_hooks, m._forward_hooks):
            for key, h in list(d.items()):
                if type(h) is BlendNormalizeBranchInput:
                    h.__class__ = hooks.NormalizeBranchInput
                    del h.transition
                elif type(h) is BlendScaleBranchOutput:
                    h.__class__ = hooks.ScaleBranchOutput
                    del h.transition
                elif isinstance(h, BlendFinalNorm):
                    del d[key]
                    m._forward_hooks_with_kwargs.pop(key, None)
                    getattr(m, "_forward_hooks_always_called", {}).pop(key, None)
    del model._modules[ATTR]
    for d in (model._load_state_dict_pre_hooks, model._load_state_dict_post_hooks):
        for key in [k for k, h in d.items() if _our_load_hook(h)]:
            del d[key]
    left = leftovers(model)
    if left:
        raise RuntimeError(f"ln_lightning: internal error, transition machinery left at {', '.join(left)}; please report this")


def leftovers(model: nn.Module) -> list[str]:
    """Module paths that still carry a piece of a transition (empty after `finish`)."""
    out = []
    for path, m in model.named_modules():
        blend_hooks = [h for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()
                       if isinstance(h, (BlendNormalizeBranchInput, BlendScaleBranchOutput, BlendFinalNorm))]
        if (ATTR in m.__dict__ or _PREV_CLASS in m.__dict__ or isinstance(m, (Transition, BlendEncoderLayer, BlendDecoderLayer))
                or blend_hooks or any(_our_load_hook(h) for d in (m._load_state_dict_pre_hooks, m._load_state_dict_post_hooks)
                                      for h in d.values())):
            out.append(path or "<root>")
    return out


def check_schedule(t: Transition, steps: int, kind: str) -> None:
    """Refuse to go on with another schedule than the one the transition (perhaps from a checkpoint) ran with:
    the blend would jump, changing the function between two steps."""
    saved_steps, saved_kind = (int(v) for v in t.schedule.tolist())
    if saved_steps > 0 and (saved_steps, SCHEDULES[saved_kind]) != (steps, kind):
        raise PlacementError(
            f"this transition ran with transition_steps={saved_steps}, transition_schedule={SCHEDULES[saved_kind]!r} (recorded "
            f"in the model and its checkpoints), not transition_steps={steps}, transition_schedule={kind!r}: continuing with "
            "another schedule would make the blend jump. Resume with the recorded values."
        )


def step_blend(t: Transition, global_step: int) -> float:
    """The blend for optimizer step `global_step` (anchoring the schedule's start at the first call)."""
    if int(t.start_step) < 0:
        t.start_step.fill_(global_step)
    return schedule((global_step - int(t.start_step)) / t.steps, t.kind)


__all__ = ["SCHEDULES", "Transition", "active", "begin", "finish", "get_blend", "leftovers", "schedule", "set_blend", "start"]
