"""The ``torch`` backend: aten's LayerNorm kernels behind ``torch.library`` custom ops.

bfloat16 CPU tensors run the compiled kernels of :mod:`._cpu_kernels` instead when they
can be built (one fused pass each way, float32 statistics); everything else runs aten's kernels.

The residual add and the residual-gradient accumulation are done around aten's
``native_layer_norm``/``native_layer_norm_backward`` with as few temporaries as possible: the
forward writes ``x + residual`` once and normalises it, keeping mean/rstd (float32) for the
backward; the backward adds the downstream residual gradient into the freshly computed input
gradient in place, where autograd would allocate a third tensor for the sum.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _common, _cpu_kernels

aten = torch.ops.aten


def _params(weight: Optional[Tensor], bias: Optional[Tensor], dtype: torch.dtype):
    """Parameters as aten's kernel takes them, plus the dtype its mean/rstd will have.

    Kept exactly as ``F.layer_norm`` would see them (half input with float32 parameters is aten's
    mixed-precision path, float32 statistics; otherwise the input dtype), so this backend's
    results equal eager PyTorch's bit for bit.
    """
    present = [p for p in (weight, bias) if p is not None]
    mixed = dtype in _common.REDUCED and any(p.dtype == torch.float32 for p in present)
    pdt = torch.float32 if mixed else dtype
    conv = lambda p: None if p is None else p.to(pdt)
    return conv(weight), conv(bias), (torch.float32 if mixed else dtype)


def add_layer_norm_impl(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    residual_in_fp32: bool,
    y_fp32: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rdt = _common.residual_dtype(x, residual, residual_in_fp32)
    if _cpu_kernels.usable_forward(x, rdt, y_fp32):
        return _compiled_forward(x, residual, weight, bias, eps, rdt)
    if residual is None:
        h = x.to(rdt)
    elif x.dtype == rdt and residual.dtype == rdt:
        h = torch.add(x, residual)
    else:
        h = x.to(rdt, copy=True)
        h.add_(residual)  # upcasts residual on the fly, no temporary
    cdt = _common.compute_dtype(rdt, y_fp32)
    w, b, _ = _params(weight, bias, cdt)
    y, mean, rstd = aten.native_layer_norm(h if h.dtype == cdt else h.to(cdt), [x.shape[-1]], w, b, eps)
    stored = _common.stores_residual(x, residual, residual_in_fp32)
    sdt = _common.stat_dtype(cdt)
    ydt = _common.output_dtype(x, y_fp32)
    return (
        y if y.dtype == ydt else y.to(ydt),
        h if stored else x.new_empty(0),
        mean.view(-1) if mean.dtype == sdt else mean.view(-1).to(sdt),
        rstd.view(-1) if rstd.dtype == sdt else rstd.view(-1).to(sdt),
    )


def add_layer_norm_backward_impl(
    dy: Tensor,
    dresidual: Optional[Tensor],
    h: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    need_weight_grad: bool,
    need_bias_grad: bool,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    if _cpu_kernels.usable_backward(dy, h):
        return _compiled_backward(dy, dresidual, h, mean, rstd, weight, bias, need_weight_grad, need_bias_grad, eps)
    cdt = torch.promote_types(h.dtype, dy.dtype)
    w, b, native_stat_dtype = _params(weight, bias, cdt)
    need_w = need_weight_grad and weight is not None
    need_b = need_bias_grad and bias is not None
    stat = lambda t: t.view(-1, 1) if t.dtype == native_stat_dtype else t.view(-1, 1).to(native_stat_dtype)
    dh, dw, db = aten.native_layer_norm_backward(
        dy if dy.dtype == cdt else dy.to(cdt), h if h.dtype == cdt else h.to(cdt), [h.shape[-1]],
        stat(mean), stat(rstd), w, b, [True, need_w, need_b],
    )
    if dh.dtype != h.dtype:
        dh = dh.to(h.dtype)
    if dresidual is not None:
        dh.add_(dresidual)  # fused residual-gradient accumulation: no extra tensor
    dw = (dw if dw.dtype == weight.dtype else dw.to(weight.dtype)) if need_w else h.new_empty(0)
    db = (db if db.dtype == bias.dtype else db.to(bias.dtype)) if need_b else h.new_empty(0)
    return dh, dw, db


def _compiled_forward(x, residual, weight, bias, eps, rdt):
    if residual is not None and residual.dtype not in (x.dtype, torch.float32):
        # The stream is float32 here: float16 + bfloat16 promotes to it (exactly), and a float64
        # residual under residual_in_fp32 is summed in float32 as that option defines.
        residual = residual.float()
    f32 = lambda p: None if p is None else p.float().contiguous()
    return tuple(_cpu_kernels.KERNELS.module().add_layer_norm_fwd(
        x, residual, f32(weight), f32(bias), float(eps), rdt == torch.float32
    ))


def _compiled_backward(dy, dresidual, h, mean, rstd, weight, bias, need_weight_grad, need_bias_grad, eps):
    need_w = need_weight_grad and weight is not None
    need_b = need_bias_grad and bias is not None
    dh, dw, db = _cpu_kernels.KERNELS.module().add_layer_norm_bwd(
        dy, dresidual, h, mean, rstd, None if weight is None else weight.float().contiguous(), need_w, need_b,
        float(eps),
    )
    dw = dw.to(weight.dtype) if need_w else h.new_empty(0)
    db = db.to(bias.dtype) if need_b else h.new_empty(0)
    return dh, dw, db


# The ops torch.compile traces (opaque to it, with fake kernels and the autograd formula).
add_layer_norm = torch.library.custom_op(f"{_common.OPS}::add_layer_norm", add_layer_norm_impl, mutates_args=())
add_layer_norm_backward = torch.library.custom_op(
    f"{_common.OPS}::add_layer_norm_backward", add_layer_norm_backward_impl, mutates_args=()
)
add_layer_norm.register_fake(_common.fake_forward)
add_layer_norm_backward.register_fake(_common.fake_backward)
_common.register_autograd(add_layer_norm, add_layer_norm_backward)
# Eager calls skip the dispatcher round trips (about 0.4 ms per forward+backward).
add_layer_norm_eager = _common.eager_function(add_layer_norm_impl, add_layer_norm_backward_impl)
