"""A function-preserving transition between norm placements, for a model that is already trained.

`convert(model, "pre")` changes what a trained post-norm model computes (by 27% on the demo LM). The
transition instead blends the two placements with one number `a` in [0, 1]. A sublayer has three places a
norm can sit: the branch's input, the branch's output (before the add) and the stream after the add. The
placement before (`S`, as the block's forward is written) and after (`T`, what `convert` made it) each put
a norm, or nothing, at each place; during the transition each place computes

    (1-a) * f_S(v) + a * f_T(v)           (f: the identity, or the norm that place has)

and the branch scale `c` ramps from 1 (`(1-a) + a*c`). Post-norm to pre-norm (norm `LN`, branch `F`):

    u = (1-a)*x + a*LN(x)                 at the branch's entries
    h = x + ((1-a) + a*c) * F(u)
    out = (1-a)*LN(h) + a*h               at the norm's own call site

Post to peri adds `b -> (1-a)*b + a*N_out(b)` at the branch's exit; pre to output moves the norm from
the input to the exit (`(1-a)*N(x) + a*x` at the input, `(1-a)*b + a*N(b)` at the exit); peri to pre and
to output drop one norm at its call site; "mix" converts the later blocks to pre-norm, as above. A final
norm that `convert` added outputs `(1-a)*s + a*N_f(s)`. At `a = 0` every term is exact (`1*x + 0*y == x`
in floating point), so the model computes bit-for-bit the function it was trained with (an added norm is
the identity); at `a = 1` it computes exactly what `convert(model, placement)` gives. `finish(model)`
then removes every piece of the machinery, leaving the model exactly as `convert` left it (fused torch
layers included), at plain speed.

What can't be blended is refused: a block an earlier rewrite of ours changed (the blend starts from the
placement the forward is written in), a conversion that removed modules, placement "post" (ln_lightning
only undoes its own rewrites, which never needs a transition).

Usage without a Trainer::

    from ln_lightning.placement import transition
    report = transition.begin(model, "pre", final_norm=True)   # convert(model, "pre", ...) at a = 0
    for step in range(n):
        transition.set_blend(model, transition.schedule((step + 1) / n))
        ...train...
    transition.finish(model)                                   # plain pre-norm from here on

With a Trainer: `LNPlacement(placement, transition_steps=N, transition_schedule="linear"|"cosine")`.

State: the blend is a persistent buffer `ln_lightning_transition.blend` on the root module (and the
step the schedule started at, `ln_lightning_transition.start_step`), so a checkpoint written
mid-transition resumes at the same point and `load_converted` restores it.

The pieces, all undone by `finish`:

* a converted block's deferred norms get the instance attribute `ln_lightning_transition` (consulted
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
from ln_lightning.placement.norms import norm_types

ATTR = "ln_lightning_transition"  # the root's submodule, and the deferred norms' instance attribute
_PREV_CLASS = "_ln_lightning_pre_transition_class"
SCHEDULES = ("linear", "cosine")
# The placements a transition can end at (from the placement each block is written in).
TARGETS = ("pre", "peri", "output", "mix")


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

    def normalized(self, t: torch.Tensor) -> torch.Tensor:
        return _mix(self.transition, t, self.norm.normalize(t))


class BlendNormalizeBranchOutput(hooks.NormalizeBranchOutput):
    """Exit hook during the transition: the branch output becomes `(1-a)*b + a*N(b)` (peri's added output
    norm, or output-norm's moved one)."""

    def normalized(self, value: torch.Tensor) -> torch.Tensor:
        return _mix(self.transition, value, super().normalized(value))


class BlendScaleBranchOutput(hooks.ScaleBranchOutput):
    """Exit hook during the transition: the branch output times `(1-a) + a*c` (1 -> c)."""

    def scaled(self, value: torch.Tensor) -> torch.Tensor:
        return _mix(self.transition, value, self.scale(value))


class BlendFinalNorm:
    """Forward hook on a final norm convert added: `(1-a)*s + a*LN_f(s)` (the identity at a = 0)."""

    def __init__(self, transition: Transition):
        self.transition = transition

    def __call__(self, module, args, output):
        if hooks.bypassed():
            return None
        return _mix(self.transition, args[0], output)


# Each hook of a rewrite and its blend-aware subclass (same attributes, plus `transition`).
_BLEND_CLASS = {
    hooks.NormalizeBranchInput: BlendNormalizeBranchInput,
    hooks.NormalizeBranchOutput: BlendNormalizeBranchOutput,
    hooks.ScaleBranchOutput: BlendScaleBranchOutput,
}
_PLAIN_CLASS = {blend: plain for plain, blend in _BLEND_CLASS.items()}


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
    """Set the blend: 0 is the function the model was trained with, 1 is what `convert` made it."""
    t = active(model)
    if t is None:
        raise PlacementError("set_blend: the model is not in a transition; start one with ln_lightning.placement.transition.begin(model)")
    a = float(a)
    if not (0.0 <= a <= 1.0):
        raise PlacementError(f"set_blend: the blend must be in [0, 1], got {a!r}")
    t.blend.fill_(a)


def begin(model: nn.Module, placement: str = "pre", *, steps: int | None = None, schedule_kind: str = "linear",
          **convert_options: Any):
    """`convert(model, placement, **convert_options)`, then the transition at a = 0 (the model's own function).

    `placement` is one of TARGETS ("pre", "peri", "output", "mix"). Returns the ConversionReport. Set the
    blend with `set_blend`, end with `finish`.
    """
    from ln_lightning.placement.engine import convert
    from ln_lightning.rewrite_record import recorded_config

    check_target(placement)
    recorded = recorded_config(model)
    if recorded is not None:
        raise PlacementError(
            f"{type(model).__name__} was already converted (to {recorded.get('placement')!r}); a transition blends from "
            "the placement the model's forward is written in. Start from the unconverted model, or convert it back "
            "with convert(model, 'post') first"
        )
    report = convert(model, placement, **convert_options)
    start(model, report, steps=steps, schedule_kind=schedule_kind)
    return report


def check_target(placement: str) -> None:
    """Raise unless a transition can end at `placement` (LNPlacement calls this at construction)."""
    if placement == "post":
        raise PlacementError(
            "transition_steps with placement='post' can't preserve the function: ln_lightning converts to post-norm "
            "only by undoing its own rewrite, which has no trained function to keep. Use placement 'pre', 'peri', "
            "'output' or 'mix', or drop transition_steps"
        )
    if placement not in TARGETS:
        raise PlacementError(f"a transition ends at one of {', '.join(map(repr, TARGETS))}, not {placement!r}")


def start(model: nn.Module, report, *, steps: int | None = None, schedule_kind: str = "linear") -> Transition:
    """Switch a model `convert` just rewrote (with `report`) into the transition at a = 0.

    Only what that conversion changed is blended (blocks it converted, final norms it added); blocks it
    left alone keep computing what they did.
    """
    if active(model) is not None:
        raise PlacementError("the model is already in a transition; finish it first (transition.finish(model))")
    if report is None or report.placement not in TARGETS:
        raise PlacementError(
            "a transition starts from the report of the conversion that rewrote the model, to one of "
            f"{', '.join(map(repr, TARGETS))} (transition.begin(model, placement) does both); a model rewritten "
            "earlier can't tell what its blocks computed before"
        )
    if report.removed:
        raise PlacementError(
            f"the conversion removed {', '.join(report.removed)}: what they computed can't be blended back in. "
            "Start the transition from the unconverted model"
        )
    rewritten = [b.path or "<root>" for b in report.converted if not b.from_written]
    if rewritten:
        raise PlacementError(
            f"block(s) {', '.join(rewritten)} had been rewritten by ln_lightning before this conversion; the transition "
            "blends from the placement a block's forward is written in, which they no longer computed. Convert the "
            "model back with convert(model, 'post') first, or start from the unconverted model"
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
                    blend = _BLEND_CLASS.get(type(h))
                    if blend is not None:
                        h.__class__, h.transition = blend, t
    # Peri's added output norms are blended at their exit hooks; every other norm the conversion added is a final norm.
    at_exits = {id(h.norm) for block in blocks for m in block.modules() for h in m._forward_hooks.values()
                if isinstance(h, hooks.NormalizeBranchOutput)}
    for path in report.added:
        try:
            m = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(m, norm_types()) and id(m) not in at_exits:  # (branch scales: at their hooks)
            m.register_forward_hook(BlendFinalNorm(t))
    model.add_module(ATTR, t)
    report.notes.append(
        "a transition is under way: at blend 0 the model computes exactly its function from before this conversion; "
        "the change above is where it ends (blend 1)"
    )
    model.register_load_state_dict_pre_hook(_SourceFinishedCheck())
    model.register_load_state_dict_post_hook(_FinishAfterLoad())
    return t


def finish(model: nn.Module) -> None:
    """End the transition: the model is exactly what `convert` made it, with no blend left.

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
                plain = _PLAIN_CLASS.get(type(h))
                if plain is not None:
                    h.__class__ = plain
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
                       if isinstance(h, (*_PLAIN_CLASS, BlendFinalNorm))]
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


__all__ = ["SCHEDULES", "TARGETS", "Transition", "active", "begin", "check_target", "finish", "get_blend", "leftovers", "schedule", "set_blend", "start"]
