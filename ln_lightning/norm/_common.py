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
# _rms_common.BACKWARD_FORM). With q = sum(g * x_hat) / sum(x_hat**2) (0 for a constant row) and
# t = eps * rstd**2:
#     dh = rstd * ((g - mean(g) - q * x_hat) + t * q * x_hat)
# and at width 2, dh = rstd * t * (g - mean(g)).
BACKWARD_FORM = "rstd * ((g - mean(g) - q * x_hat) + eps * rstd**2 * q * x_hat)"


def residual_dtype(x: torch.Tensor, residual: Optional[torch.Tensor], residual_in_fp32: bool) -> torch.dtype:
    if residual_in_fp32:
        return torch.float32 if x.dtype != torch.float64 else torch.float64
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def stores_residual(x: torch.Tensor, residual: Optional[torch.Tensor], residual_in_fp32: bool) -> bool:
    return residual is not None or residual_dtype(x, residual, residual_in_fp32) != x.dtype


def compute_dtype(h_dtype: torch.dtype, y_fp32: bool) -> torch.dtype:
    return torch.promote_types(h_dtype, torch.float32) if y_fp32 else h_dtype


def output_dtype(x: torch.Tensor, y_fp32: bool) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32) if y_fp32 else x.dtype


def stat_dtype(compute: torch.dtype) -> torch.dtype:
    # The ops return float32 statistics for half inputs (the Triton kernels compute them in
    # float32; aten's half kernel keeps them in half, which converts to float32 losslessly).
    return torch.float64 if compute == torch.float64 else torch.float32


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, residual_in_fp32, _y_fp32 = inputs
    _y, residual_out, mean, rstd = output
    ctx.eps = eps
    ctx.stored = stores_residual(x, residual, residual_in_fp32)
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.save_for_backward(residual_out if ctx.stored else x, weight, bias, mean, rstd)


def _backward(bwd, ctx, dy, dresidual):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    need_x, need_res, need_w, need_b = ctx.needs_input_grad[:4]
    if not ctx.stored:
        dresidual = None  # the placeholder output carries no gradient
    need_w = need_w and weight is not None
    need_b = need_b and bias is not None
    if dy is None:
        if dresidual is None:
            return None, None, None, None, None, None, None
        dh, dweight, dbias = dresidual, None, None
    else:
        dh, dweight, dbias = bwd(
            dy.contiguous(),
            None if dresidual is None else dresidual.contiguous(),
            h, mean, rstd, weight, bias, need_w, need_b, ctx.eps,
        )
    dx = (dh if dh.dtype == ctx.x_dtype else dh.to(ctx.x_dtype)) if need_x else None
    dr = None
    if need_res and ctx.residual_dtype is not None:
        dr = dh if dh.dtype == ctx.residual_dtype else dh.to(ctx.residual_dtype)
    return dx, dr, (dweight if need_w else None), (dbias if need_b else None), None, None, None


def register_autograd(fwd_op, bwd_op) -> None:
    """Attach the backward formula (calling the op ``bwd_op``) to the forward op ``fwd_op``."""

    def backward(ctx, dy, dresidual, _dmean, _drstd):
        return _backward(bwd_op, ctx, dy, dresidual)

    fwd_op.register_autograd(backward, setup_context=_setup_context)


def eager_function(fwd_impl, bwd_impl):
    """The same forward/backward as a plain ``autograd.Function``, for eager calls.

    A ``torch.library`` op costs a few dispatcher round trips per call (about 0.4 ms per forward
    plus backward on CPU); outside ``torch.compile`` they buy nothing, so eager calls use this.
    """

    class _AddLayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            ctx.set_materialize_grads(False)  # unused outputs: None, not a zeros tensor
            output = fwd_impl(*inputs)
            _setup_context(ctx, inputs, output)
            ctx.mark_non_differentiable(output[2], output[3])
            if not ctx.stored:
                ctx.mark_non_differentiable(output[1])
            return output

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dy, dresidual, _dmean, _drstd):
            return _backward(bwd_impl, ctx, dy, dresidual)

    _AddLayerNorm.__name__ = _AddLayerNorm.__qualname__ = f"AddLayerNorm_{fwd_impl.__module__.rsplit('.', 1)[-1]}"
    return _AddLayerNorm.apply


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
