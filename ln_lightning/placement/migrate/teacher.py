"""Distillation towards the trained function while a transition blends (LNPlacement's ``transition_distill``).

Measured on a trained 12-layer post-norm LM (examples/migrate_trained.py, issue 20): a transition that also
minimises KL(trained || model) on each training batch follows the function it starts from more closely, and
its held-out loss stays within noise where the blend alone rises at its end. The *teacher* is the trained
function: a frozen copy of the model taken when the transition starts, at blend 0 (bit for bit the function it
was trained with).

Cost: one copy of the weights (no gradients, no optimizer state), and one forward of it per training forward
while the transition runs (in the model's mode, drawing the same random numbers as the model's forward, so the
same dropout masks: LNPlacement's distillation forks the random state; the rewrite's hooks bypassed, so a
plain forward of the model as written); dropped when the transition ends.

The copy keeps the rewrite's own hooks (the blend at 0 needs them) and drops every other hook (a monitor on a
norm must not record the teacher's forward); a user hook that changes a module's output is therefore not in the
teacher's function, only in the model's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ln_lightning.placement.migrate import blend
from ln_lightning.placement.rewrite import hooks


def _ours(hook: Any) -> bool:
    owner = getattr(hook, "__self__", hook)  # a bound method (TapStream.tap): its object's class
    return type(owner).__module__.startswith("ln_lightning.placement.")


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of `model` (in a transition) that computes its blend-0 function: the trained one."""
    trainer = model.__dict__.get("_trainer")
    if trainer is not None:
        model._trainer = None  # a LightningModule: the Trainer is not part of the function
    try:
        teacher = copy.deepcopy(model)
    finally:
        if trainer is not None:
            model._trainer = trainer
    for m in teacher.modules():
        for hooks_of in (m._forward_pre_hooks, m._forward_hooks):
            for key in [k for k, h in hooks_of.items() if not _ours(h)]:
                del hooks_of[key]
                m._forward_hooks_with_kwargs.pop(key, None)
                m._forward_pre_hooks_with_kwargs.pop(key, None)
                getattr(m, "_forward_hooks_always_called", {}).pop(key, None)
        for name in ("_ln_pre_hooks", "_ln_post_hooks"):  # hooks registered on a deferred norm (hooks.DeferredNorm)
            if isinstance(m.__dict__.get(name), dict):
                m.__dict__[name].clear()
    t = blend.active(teacher)
    if t is None:
        raise RuntimeError("frozen_copy: the model is not in a transition")
    t.set_progress(0, 0.0)
    t.abandon_measurement()
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    teacher.__dict__[_BYPASS] = not any(isinstance(m, (blend.BlendEncoderLayer, blend.BlendDecoderLayer)) for m in teacher.modules())
    return teacher


_BYPASS = "_ln_lightning_teacher_bypass"  # on a teacher: its hooks can be bypassed bit for bit


@torch.no_grad()
def trained_output(teacher: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The teacher's output: the model as written, with the rewrite's hooks bypassed (`hooks.bypass`, what the
    engine checks against), so a plain forward of it rather than one of the blend; at blend 0 the two are the
    same function bit for bit. A torch Transformer layer in the blend is the exception (its bypassed norm rounds
    differently): such a teacher runs its blend, pinned at 0."""
    if teacher.__dict__.get(_BYPASS):
        with hooks.bypass():
            return teacher(*args, **kwargs)
    return teacher(*args, **kwargs)


def logits_of(output: Any) -> torch.Tensor | None:
    """The tensor a model's output predicts with: the output itself, its ``logits`` (a Hugging Face ModelOutput
    or a dict), or the first element of a tuple, if it is a floating tensor of scores over a last dimension of
    several classes; None otherwise (a loss, one score per row, an integer tensor)."""
    if isinstance(output, dict):  # (ModelOutput is a dict)
        v = output.get("logits")
    elif isinstance(output, (tuple, list)) and output:
        v = output[0]
    else:
        v = output
    # Scores over classes: floating, with a last dimension of several classes (not a loss, not one score per row).
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2 and v.size(-1) > 1:
        return v
    return None


def _weighted_gap(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``p * (a - b)`` where ``p > 0``, else 0: a class with no probability (a logit masked at -inf, whose log-
    probability difference is -inf - -inf, not a number) adds nothing, as it does to the KL. The same value, bit for
    bit, wherever the logits are finite."""
    return torch.where(p > 0, p * (a - b), torch.zeros_like(p))


def kl_per_position(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of the distributions over the last dimension, one per position (flattened); a class
    the teacher gives no probability adds nothing (one both mask at -inf made it NaN)."""
    t = F.log_softmax(teacher.detach().reshape(-1, teacher.size(-1)).float(), -1)
    s = F.log_softmax(student.reshape(-1, student.size(-1)).float(), -1)
    return _weighted_gap(t.exp(), t, s).sum(-1)


def kl_to_teacher(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of the distributions over the last dimension, per position, averaged (0-dim)."""
    return kl_per_position(student, teacher).mean()


def mean_where_the_loss_looks(kl: torch.Tensor, loss_grad: torch.Tensor | None) -> torch.Tensor:
    """The mean of per-position `kl` over the positions where `loss_grad` (the loss's gradient with respect to the
    output, or None: the loss does not depend on it) is not zero; over every position where there are none. On the
    device: no host read."""
    if loss_grad is None:
        return kl.mean()
    looked = (loss_grad.reshape(-1, loss_grad.size(-1)) != 0).any(-1).to(kl.dtype)
    n = looked.sum()
    # Where the loss looks at every position (or at none) this is kl.mean() itself, bit for bit.
    return torch.where((n > 0) & (n < kl.numel()), (kl * looked).sum() / n.clamp(min=1), kl.mean())


# loss_excess works through the rows in chunks of at most this many elements: its float32 temporaries then stay
# near 16 MB each, whatever the vocabulary and the batch (a 50k-word LM over 4k tokens is 2e8 elements a tensor).
_EXCESS_CHUNK = 1 << 22


def loss_excess(loss_grad: torch.Tensor | None, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """L(student) - L(teacher): how much more the training loss is on this batch for the model's output than it would
    be for the trained function's (the same inputs and dropout masks), from `loss_grad` (the loss's gradient with
    respect to `student`; None: the loss does not depend on it, 0). A 0-dim float tensor, on the device.

    With ``d = student - teacher`` and ``g = loss_grad``, ``<g, d>`` is the first-order difference, and for a loss
    convex in the output (cross-entropy, squared error) an upper bound of it. For a softmax cross-entropy with hard
    labels, whatever its weights (a mean over the positions an ignore_index leaves, a sum), the gradient is
    ``g_i = w_i (q_i - e_{y_i})`` and the difference is exact: ``<g, d> - sum_i w_i KL(q_i || p_i)`` (the Bregman
    divergence of log-sum-exp), with ``y_i`` the one negative entry of ``g_i`` and ``w_i`` the sum of the others
    over ``1 - q_{i,y_i}`` (computed as ``-expm1(log q)``: no cancellation where the model is confident). Whether
    the gradient has that form is checked on the whole batch, within its dtype's rounding (a bfloat16 gradient's
    too); one of any other form (label smoothing, a regression) gets the bound. No host read; the rows are taken in
    chunks, so the memory it needs does not grow with the batch."""
    if loss_grad is None:
        return student.new_zeros((), dtype=torch.float32)
    n = student.size(-1)
    g_all, zs_all, zt_all = (t.detach().reshape(-1, n) for t in (loss_grad, student, teacher))
    # The gradient's own rounding (4 ulps of its dtype, at least 1e-3) is what "of that form" is checked within.
    within = max(1e-3, 4 * torch.finfo(g_all.dtype).eps) if g_all.is_floating_point() else 1e-3
    first = exact_gap = mismatch = size = zs_all.new_zeros((), dtype=torch.float32)
    rows = max(1, _EXCESS_CHUNK // max(1, n))
    for start in range(0, g_all.size(0), rows):
        g, zs, zt = (t[start:start + rows].float() for t in (g_all, zs_all, zt_all))
        first = first + torch.where(g != 0, g * (zs - zt), torch.zeros_like(g)).sum()  # (a masked class: g is 0)
        log_q = F.log_softmax(zs, -1)
        y = g.argmin(-1, keepdim=True)
        g_y = g.gather(-1, y).squeeze(-1)
        w = (g.sum(-1) - g_y) / (-torch.expm1(log_q.gather(-1, y).squeeze(-1))).clamp(min=torch.finfo(torch.float32).tiny)
        q = log_q.exp()
        rebuilt = w[:, None] * q
        rebuilt.scatter_add_(-1, y, -w[:, None])
        mismatch = mismatch + (rebuilt - g).abs().sum()
        size = size + g.abs().sum()
        exact_gap = exact_gap + (w * _weighted_gap(q, log_q, F.log_softmax(zt, -1)).sum(-1)).sum()
    cross_entropy = mismatch <= within * size + 1e-30
    return torch.where(cross_entropy, first - exact_gap, first)


__all__ = ["frozen_copy", "kl_per_position", "kl_to_teacher", "logits_of", "loss_excess", "mean_where_the_loss_looks",
           "trained_output"]
