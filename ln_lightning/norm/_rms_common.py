"""Dtype rules and the autograd formula shared by the torch and Triton RMSNorm backends.

Each backend registers two ``torch.library`` ops with the same schema:

``fwd(x, residual, weight, eps, residual_in_fp32, offset, cast) -> (y, residual_out, rstd)``
    ``x``/``residual``: (rows, hidden) contiguous; ``weight``: (hidden,) or None. ``residual_out``
    follows the LayerNorm ops' rules (:mod:`._common`: ``x + residual`` in
    :func:`~._common.residual_dtype`, or an empty placeholder when nothing is stored).
    ``rstd``: (rows,) ``1 / sqrt(mean(h**2) + eps)``, float32 (float64 for float64 input).
    ``y = cast_order(h * rstd) * (offset + weight)``, see :data:`CAST_ORDERS`.
``bwd(dy, dresidual, h, rstd, weight, offset, need_weight_grad, eps) -> (dh, dweight)``
    ``dh = rstd * (g - n * mean(g * n)) + dresidual`` with ``n = h * rstd`` and
    ``g = dy * (offset + weight)``; ``dweight = sum_rows(dy * n)`` (float32 accumulation), or an
    empty placeholder. The weight gradient uses ``n`` before any cast-order rounding: the
    rounding's derivative is 1 (as autograd treats ``.to()``), and the unrounded sum is the more
    accurate one.

    Every backend evaluates ``dh`` without that formula's cancellation (:data:`BACKWARD_FORM`), which is
    why it needs ``eps``.

Unlike the LayerNorm ops' mean, ``rstd`` means the same thing on every backend and kernel, so a
forward on one and a backward on another would still agree.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import REDUCED, residual_dtype, stores_residual

# How the normalised value meets the weight, named after the classes that define each order:
#   "fp32":  (n * (offset + w.float())).to(x.dtype)    nn.RMSNorm, Gemma 2/3, OLMo 2
#   "llama": w * n.to(x.dtype)                          Llama, Qwen2, Mistral, DeepSeek, ...
#   "t5":    w * (n.to(w.dtype) if w is half else n)    T5LayerNorm
# (n = h * rstd, computed in float32 or float64.) The product is taken in float32 and rounded
# once: for half operands that equals PyTorch's own half multiply.
CAST_ORDERS = ("fp32", "llama", "t5")

# How every backend evaluates the input gradient (the compiled CPU kernel, the aten composition and the
# Triton kernels write out this same form). The textbook rstd * (g - n * mean(g * n)) multiplies g's
# component along n by 1 - mean(n**2) = eps * rstd**2, but computes that factor as the difference of two
# nearly equal terms: at width 1 it is g * (1 - n**2) with 1 - n**2 = 2.5e-6 at h = 2 (eps 1e-5), and a
# float32 n**2 is only known to 6e-8, so dh carried a relative error of percents (6.0e-6 against torch's
# 1.1e-6 in issue 23). Split into the part of g perpendicular to n and the part along it, with
# q = sum(g * n) / sum(n * n) (0 for a zero row) and t = eps * rstd**2, exact to rounding:
#     dh = rstd * ((g - q * n) + t * q * n)
# and at width 1, where g has no perpendicular part, dh = rstd * t * g. The perpendicular part g - q * n
# cancels in turn when g lies near n (a constant row; Gemma's 1 + w makes g larger against it): every backend
# takes q * n as (sum(g * h) / sum(h * h)) * h with those sums in float64, and rounds g - q * n about once
# (issue 32: single rows at 1.2-1.9x the 2x-torch bound at widths 2 to 255 before).
BACKWARD_FORM = "rstd * ((g - q * n) + eps * rstd**2 * q * n)"


def check_cast(cast: str) -> str:
    if cast not in CAST_ORDERS:
        raise ValueError(f"unknown RMSNorm cast order {cast!r}: choose one of {CAST_ORDERS}")
    return cast


def round_dtype(cast: str, x_dtype: torch.dtype, w_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype ``n`` is rounded to before the weight multiply, or None."""
    if cast == "llama":
        return x_dtype if x_dtype in REDUCED else None
    if cast == "t5":
        return w_dtype if w_dtype in REDUCED else None
    return None


def output_dtype(cast: str, x_dtype: torch.dtype, w_dtype: Optional[torch.dtype]) -> torch.dtype:
    """``y``'s dtype, as the reference module's type promotion gives it (``x``'s without a weight)."""
    if w_dtype is None:
        return x_dtype
    if cast == "llama":
        return torch.promote_types(w_dtype, x_dtype)
    if cast == "t5":
        return w_dtype if w_dtype in REDUCED else torch.promote_types(torch.promote_types(x_dtype, torch.float32), w_dtype)
    return x_dtype


def compute_dtype(h_dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(h_dtype, torch.float32)


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps, residual_in_fp32, offset, _cast = inputs
    _y, residual_out, rstd = output
    ctx.stored = stores_residual(x, residual, residual_in_fp32)
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.offset = offset
    ctx.eps = eps
    ctx.save_for_backward(residual_out if ctx.stored else x, weight, rstd)


def _backward(bwd, ctx, dy, dresidual):
    h, weight, rstd = ctx.saved_tensors
    need_x, need_res, need_w = ctx.needs_input_grad[:3]
    if not ctx.stored:
        dresidual = None  # the placeholder output carries no gradient
    need_w = need_w and weight is not None
    none = (None,) * 4
    if dy is None:
        if dresidual is None:
            return (None, None, None) + none
        dh, dweight = dresidual, None
    else:
        dh, dweight = bwd(
            dy.contiguous(), None if dresidual is None else dresidual.contiguous(),
            h, rstd, weight, ctx.offset, need_w, ctx.eps,
        )
    dx = (dh if dh.dtype == ctx.x_dtype else dh.to(ctx.x_dtype)) if need_x else None
    dr = None
    if need_res and ctx.residual_dtype is not None:
        dr = dh if dh.dtype == ctx.residual_dtype else dh.to(ctx.residual_dtype)
    return (dx, dr, dweight if need_w else None) + none


def register_autograd(fwd_op, bwd_op) -> None:
    """Attach the backward formula (calling the op ``bwd_op``) to the forward op ``fwd_op``."""

    def backward(ctx, dy, dresidual, _drstd):
        return _backward(bwd_op, ctx, dy, dresidual)

    fwd_op.register_autograd(backward, setup_context=_setup_context)


def eager_function(fwd_impl, bwd_impl):
    """The same forward/backward as a plain ``autograd.Function``, for eager calls (no dispatcher
    round trips, see :func:`._common.eager_function`)."""

    class _AddRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            ctx.set_materialize_grads(False)
            output = fwd_impl(*inputs)
            _setup_context(ctx, inputs, output)
            ctx.mark_non_differentiable(output[2])
            if not ctx.stored:
                ctx.mark_non_differentiable(output[1])
            return output

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dy, dresidual, _drstd):
            return _backward(bwd_impl, ctx, dy, dresidual)

    _AddRMSNorm.__name__ = _AddRMSNorm.__qualname__ = f"AddRMSNorm_{fwd_impl.__module__.rsplit('.', 1)[-1]}"
    return _AddRMSNorm.apply


def fake_forward(x, residual, weight, eps, residual_in_fp32, offset, cast):
    rdt = residual_dtype(x, residual, residual_in_fp32)
    res_out = x.new_empty(x.shape, dtype=rdt) if stores_residual(x, residual, residual_in_fp32) else x.new_empty(0)
    sdt = torch.float64 if compute_dtype(rdt) == torch.float64 else torch.float32
    ydt = output_dtype(cast, x.dtype, None if weight is None else weight.dtype)
    return x.new_empty(x.shape, dtype=ydt), res_out, x.new_empty(x.shape[0], dtype=sdt)


def fake_backward(dy, dresidual, h, rstd, weight, offset, need_weight_grad, eps):
    dw = torch.empty_like(weight) if (need_weight_grad and weight is not None) else h.new_empty(0)
    return torch.empty_like(h), dw
