"""Dtype rules and the autograd formula shared by the torch and Triton backends.

Each backend registers two ``torch.library`` ops with the same schema:

``fwd(x, residual, weight, bias, eps, residual_in_fp32, y_fp32) -> (y, residual_out, mean, rstd)``
    ``x``/``residual``: (rows, hidden) contiguous; ``weight``/``bias``: (hidden,) or None.
    ``residual_out`` is ``x + residual`` in :func:`residual_dtype`, or an empty placeholder when
    :func:`stores_residual` is false (the caller then returns ``x`` itself: an op output may not
    alias an input). ``mean``/``rstd``: (rows,), float32 (float64 for float64 input); they are
    private to the backend's own backward (the Triton backend stores the mean of ``h - h[:, 0]``).
``bwd(dy, dresidual, h, mean, rstd, weight, bias, need_weight_grad, need_bias_grad, eps) -> (dh, dweight, dbias)``
    ``h`` is the normalised input (``residual_out``, or ``x``); ``dresidual`` the gradient arriving
    at ``residual_out`` from downstream, added into ``dh`` inside the same pass. Unrequested
    ``dweight``/``dbias`` come back as empty placeholders. Our own kernels (the compiled CPU ones,
    Triton) evaluate ``dh`` in the form of :data:`BACKWARD_FORM`, which needs ``eps``; aten's does not.

RMSNorm's ops (``rms=True`` below; one autograd glue serves both norms, as flash-attn's ``IS_RMS_NORM``):

``fwd(x, residual, weight, eps, residual_in_fp32, offset, cast) -> (y, residual_out, rstd)``
    ``residual_out`` follows the rules above. ``rstd``: (rows,) ``1 / sqrt(mean(h**2) + eps)``, float32 (float64
    for float64 input). ``y = cast_order(h * rstd) * (offset + weight)``, see :data:`CAST_ORDERS`.
``bwd(dy, dresidual, h, rstd, weight, offset, need_weight_grad, eps) -> (dh, dweight)``
    ``dh = rstd * (g - n * mean(g * n)) + dresidual`` with ``n = h * rstd`` and ``g = dy * (offset + weight)``,
    evaluated as :data:`RMS_BACKWARD_FORM`; ``dweight = sum_rows(dy * n)`` (float32 accumulation), or an empty
    placeholder. The weight gradient uses ``n`` before any cast-order rounding: the rounding's derivative is 1
    (as autograd treats ``.to()``), and the unrounded sum is the more accurate one. Unlike the LayerNorm ops'
    mean, ``rstd`` means the same thing on every backend and kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

REDUCED = (torch.float16, torch.bfloat16)

# The torch.library namespace of every op here, versioned: bump it whenever an op's schema changes.
# torch.compile's caches (AOTAutograd, FX graph) key a compiled backward on the forward graph, which
# names the forward op only, so a backward compiled against an older schema would be replayed after an
# upgrade (seen when the backward ops gained `eps`: "missing value for argument 'eps'").
OPS = "ln_lightning_v2"

# How our LayerNorm kernels evaluate the input gradient, g = dy * w. The textbook
# rstd * (g - mean(g) - x_hat * mean(g * x_hat)) multiplies g's component along x_hat by
# 1 - mean(x_hat**2) = eps * rstd**2 but computes it as a difference of nearly equal terms; at width 2,
# where g - mean(g) lies entirely along x_hat, that is all there is (the RMSNorm form at width 1, see
# RMS_BACKWARD_FORM). With q = sum(g * x_hat) / sum(x_hat**2) (0 for a constant row) and
# t = eps * rstd**2:
#     dh = rstd * ((g - mean(g) - q * x_hat) + t * q * x_hat)
# and at width 2, dh = rstd * t * (g - mean(g)).
BACKWARD_FORM = "rstd * ((g - mean(g) - q * x_hat) + eps * rstd**2 * q * x_hat)"

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
RMS_BACKWARD_FORM = "rstd * ((g - q * n) + eps * rstd**2 * q * n)"


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


def rms_output_dtype(cast: str, x_dtype: torch.dtype, w_dtype: Optional[torch.dtype]) -> torch.dtype:
    """``y``'s dtype, as the reference module's type promotion gives it (``x``'s without a weight)."""
    if w_dtype is None:
        return x_dtype
    if cast == "llama":
        return torch.promote_types(w_dtype, x_dtype)
    if cast == "t5":
        return w_dtype if w_dtype in REDUCED else torch.promote_types(torch.promote_types(x_dtype, torch.float32), w_dtype)
    return x_dtype


def residual_dtype(x: torch.Tensor, residual: Optional[torch.Tensor], residual_in_fp32: bool) -> torch.dtype:
    if residual_in_fp32:
        return torch.float32 if x.dtype != torch.float64 else torch.float64
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def stores_residual(x: torch.Tensor, residual: Optional[torch.Tensor], residual_in_fp32: bool) -> bool:
    return residual is not None or residual_dtype(x, residual, residual_in_fp32) != x.dtype


def compute_dtype(h_dtype: torch.dtype, y_fp32: bool) -> torch.dtype:
    """The dtype the norm is computed in: at least float32 with ``y_fp32`` (always, for RMSNorm)."""
    return torch.promote_types(h_dtype, torch.float32) if y_fp32 else h_dtype


def output_dtype(x: torch.Tensor, y_fp32: bool) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32) if y_fp32 else x.dtype


def stat_dtype(compute: torch.dtype) -> torch.dtype:
    # The ops return float32 statistics for half inputs (the Triton kernels compute them in
    # float32; aten's half kernel keeps them in half, which converts to float32 losslessly).
    return torch.float64 if compute == torch.float64 else torch.float32


def _setup_context(rms: bool, ctx, inputs, output):
    if rms:
        x, residual, weight, eps, residual_in_fp32, offset, _cast = inputs
        bias, stats = None, output[2:]
    else:
        x, residual, weight, bias, eps, residual_in_fp32, _y_fp32 = inputs
        offset, stats = 0.0, output[2:]
    ctx.rms, ctx.eps, ctx.offset = rms, eps, offset
    ctx.stored = stores_residual(x, residual, residual_in_fp32)
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.save_for_backward(output[1] if ctx.stored else x, weight, bias, *stats)


def _backward(bwd, ctx, dy, dresidual):
    """The gradients of the forward's 7 inputs: (dx, dresidual, dweight, dbias or None, None, None, None)."""
    h, weight, bias, *stats = ctx.saved_tensors
    need_x, need_res, need_w = ctx.needs_input_grad[:3]
    need_b = not ctx.rms and ctx.needs_input_grad[3] and bias is not None
    if not ctx.stored:
        dresidual = None  # the placeholder output carries no gradient
    need_w = need_w and weight is not None
    if dy is None:
        if dresidual is None:
            return (None,) * 7
        dh, dweight, dbias = dresidual, None, None
    else:
        dy, dres = dy.contiguous(), None if dresidual is None else dresidual.contiguous()
        if ctx.rms:
            (dh, dweight), dbias = bwd(dy, dres, h, *stats, weight, ctx.offset, need_w, ctx.eps), None
        else:
            dh, dweight, dbias = bwd(dy, dres, h, *stats, weight, bias, need_w, need_b, ctx.eps)
    dx = (dh if dh.dtype == ctx.x_dtype else dh.to(ctx.x_dtype)) if need_x else None
    dr = None
    if need_res and ctx.residual_dtype is not None:
        dr = dh if dh.dtype == ctx.residual_dtype else dh.to(ctx.residual_dtype)
    return dx, dr, (dweight if need_w else None), (dbias if need_b else None), None, None, None


def register_autograd(fwd_op, bwd_op, rms: bool = False) -> None:
    """Attach the backward formula (calling the op ``bwd_op``) to the forward op ``fwd_op``."""

    def backward(ctx, dy, dresidual, *_dstats):
        return _backward(bwd_op, ctx, dy, dresidual)

    fwd_op.register_autograd(backward, setup_context=lambda ctx, inputs, output: _setup_context(rms, ctx, inputs, output))


def eager_function(fwd_impl, bwd_impl, rms: bool = False):
    """The same forward/backward as a plain ``autograd.Function``, for eager calls.

    A ``torch.library`` op costs a few dispatcher round trips per call (about 0.4 ms per forward
    plus backward on CPU); outside ``torch.compile`` they buy nothing, so eager calls use this.
    """

    class _AddNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            ctx.set_materialize_grads(False)  # unused outputs: None, not a zeros tensor
            output = fwd_impl(*inputs)
            _setup_context(rms, ctx, inputs, output)
            ctx.mark_non_differentiable(*output[2:])
            if not ctx.stored:
                ctx.mark_non_differentiable(output[1])
            return output

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dy, dresidual, *_dstats):
            return _backward(bwd_impl, ctx, dy, dresidual)

    name = f"{'AddRMSNorm' if rms else 'AddLayerNorm'}_{fwd_impl.__module__.rsplit('.', 1)[-1]}"
    _AddNorm.__name__ = _AddNorm.__qualname__ = name
    return _AddNorm.apply


def fake_forward(x, residual, weight, bias, eps, residual_in_fp32, y_fp32):
    rows = x.shape[0]
    rdt = residual_dtype(x, residual, residual_in_fp32)
    res_out = x.new_empty(x.shape, dtype=rdt) if stores_residual(x, residual, residual_in_fp32) else x.new_empty(0)
    sdt = stat_dtype(compute_dtype(rdt, y_fp32))
    return (
        x.new_empty(x.shape, dtype=output_dtype(x, y_fp32)),
        res_out,
        x.new_empty(rows, dtype=sdt),
        x.new_empty(rows, dtype=sdt),
    )


def fake_backward(dy, dresidual, h, mean, rstd, weight, bias, need_weight_grad, need_bias_grad, eps):
    dw = torch.empty_like(weight) if (need_weight_grad and weight is not None) else h.new_empty(0)
    db = torch.empty_like(bias) if (need_bias_grad and bias is not None) else h.new_empty(0)
    return torch.empty_like(h), dw, db


def rms_fake_forward(x, residual, weight, eps, residual_in_fp32, offset, cast):
    rdt = residual_dtype(x, residual, residual_in_fp32)
    res_out = x.new_empty(x.shape, dtype=rdt) if stores_residual(x, residual, residual_in_fp32) else x.new_empty(0)
    sdt = stat_dtype(compute_dtype(rdt, True))
    ydt = rms_output_dtype(cast, x.dtype, None if weight is None else weight.dtype)
    return x.new_empty(x.shape, dtype=ydt), res_out, x.new_empty(x.shape[0], dtype=sdt)


def rms_fake_backward(dy, dresidual, h, rstd, weight, offset, need_weight_grad, eps):
    dw = torch.empty_like(weight) if (need_weight_grad and weight is not None) else h.new_empty(0)
    return torch.empty_like(h), dw
