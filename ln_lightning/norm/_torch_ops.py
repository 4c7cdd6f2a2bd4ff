"""The ``torch`` backend of both norms, behind ``torch.library`` custom ops (schemas: :mod:`._common`).

LayerNorm: aten's kernels. bfloat16 CPU tensors run the compiled kernels of :mod:`._cpu_kernels` instead when
they can be built (one fused pass each way, float32 statistics); everything else runs aten's kernels. The
residual add and the residual-gradient accumulation are done around aten's
``native_layer_norm``/``native_layer_norm_backward`` with as few temporaries as possible: the forward writes
``x + residual`` once and normalises it, keeping mean/rstd (float32) for the backward; the backward adds the
downstream residual gradient into the freshly computed input gradient in place, where autograd would allocate a
third tensor for the sum.

RMSNorm: float32 and bfloat16 CPU tensors run the same compiled kernels (their RMS instantiation) when they can
be built; everything else (float16, float64, other devices, a failed build) runs a composition of aten ops
computing the same formula in float32 (float64 for float64).
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


def _stream(x: Tensor, residual: Optional[Tensor], rdt: torch.dtype) -> Tensor:
    """h = x + residual in the residual dtype (both norms' forward)."""
    if residual is None:
        return x.to(rdt)
    if x.dtype == rdt and residual.dtype == rdt:
        return torch.add(x, residual)
    h = x.to(rdt, copy=True)
    h.add_(residual)  # upcasts residual on the fly, no temporary
    return h


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
    h = _stream(x, residual, rdt)
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


# ------------------------------------------------------------------------------------------ RMSNorm

def _weight_dtype(weight: Optional[Tensor]) -> Optional[torch.dtype]:
    return None if weight is None else weight.dtype


def apply_weight(n: Tensor, weight: Optional[Tensor], offset: float, rnd: Optional[torch.dtype],
                 ydt: torch.dtype) -> Tensor:
    """``y`` from the normalised ``n`` (compute dtype) in the cast order ``rnd`` describes."""
    if rnd is not None:
        n = n.to(rnd).to(n.dtype)
    if weight is not None:
        w = weight.to(n.dtype)
        n.mul_(w + offset if offset else w)  # n is always a fresh temporary here
    return n if n.dtype == ydt else n.to(ydt)


def rms_compiled_kernel_takes(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], residual_in_fp32: bool,
                          cast: str) -> bool:
    """Whether :func:`add_rms_norm_impl` runs these inputs on the compiled CPU kernel (else on aten ops)."""
    rdt = _common.residual_dtype(x, residual, residual_in_fp32)
    wdt = _weight_dtype(weight)
    return _cpu_kernels.rms_usable_forward(x, rdt, _common.round_dtype(cast, x.dtype, wdt),
                                           _common.rms_output_dtype(cast, x.dtype, wdt))


def add_rms_norm_impl(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    eps: float,
    residual_in_fp32: bool,
    offset: float,
    cast: str,
) -> tuple[Tensor, Tensor, Tensor]:
    rdt = _common.residual_dtype(x, residual, residual_in_fp32)
    rnd = _common.round_dtype(cast, x.dtype, _weight_dtype(weight))
    ydt = _common.rms_output_dtype(cast, x.dtype, _weight_dtype(weight))
    if _cpu_kernels.rms_usable_forward(x, rdt, rnd, ydt):
        return _rms_compiled_forward(x, residual, weight, eps, rdt, offset, rnd is not None)
    h = _stream(x, residual, rdt)
    cdt = _common.compute_dtype(rdt, True)
    hc = h if h.dtype == cdt else h.to(cdt)
    # the mean square as the reference modules take it (a squared temporary): vector_norm(h)**2, one pass
    # without it, drifted past 2x their error on wide constant rows (1.8x at width 4096, 2.9x at 8200)
    rstd = hc.square().mean(-1).add_(eps).rsqrt_()
    y = apply_weight(hc * rstd.unsqueeze(-1), weight, offset, rnd, ydt)
    stored = _common.stores_residual(x, residual, residual_in_fp32)
    return y, (h if stored else x.new_empty(0)), rstd


def add_rms_norm_backward_impl(
    dy: Tensor,
    dresidual: Optional[Tensor],
    h: Tensor,
    rstd: Tensor,
    weight: Optional[Tensor],
    offset: float,
    need_weight_grad: bool,
    eps: float,
) -> tuple[Tensor, Tensor]:
    need_w = need_weight_grad and weight is not None
    if _cpu_kernels.rms_usable_backward(dy, h, None):
        return _rms_compiled_backward(dy, dresidual, h, rstd, weight, offset, need_w, eps)
    cdt = torch.promote_types(_common.compute_dtype(h.dtype, True), dy.dtype)
    hc = h if h.dtype == cdt else h.to(cdt)
    r = rstd.to(cdt).unsqueeze(-1)
    n = hc * r
    dyc = dy if dy.dtype == cdt else dy.to(cdt)
    g = dyc if weight is None else dyc * (weight.to(cdt) + offset)
    # _common.RMS_BACKWARD_FORM, without the textbook form's cancellation (no host sync: where, not if),
    # evaluated in float64 with q n = (sum(g h) / sum(h h)) h: g - q n also cancels when g lies near n
    # (issue 32), and rounding it once keeps it within torch's own error row by row.
    wide = torch.float64
    gw, hw, rw = g.to(wide), hc.to(wide), rstd.to(wide).unsqueeze(-1)
    t = rw.square().mul_(eps)
    if h.shape[-1] == 1:  # no part of g perpendicular to n
        dh = gw * t.mul_(rw)
    else:
        shh = hw.square().sum(-1, keepdim=True)
        q = (gw * hw).sum(-1, keepdim=True).div_(torch.where(shh > 0, shh, 1))
        dh = torch.addcmul(gw, q, hw, value=-1).addcmul_(t.mul_(q), hw).mul_(rw)
    dh = dh.to(h.dtype)
    if dresidual is not None:
        dh.add_(dresidual)  # fused residual-gradient accumulation: no extra tensor
    dw = (dyc * n).sum(0).to(weight.dtype) if need_w else h.new_empty(0)
    return dh, dw


def _rms_compiled_forward(x, residual, weight, eps, rdt, offset, round_normed):
    if residual is not None and residual.dtype not in (x.dtype, torch.float32):
        # The stream is float32 here (see _cpu_kernels.usable_forward for the same rule).
        residual = residual.float()
    w = None if weight is None else weight.float().contiguous()
    return tuple(_cpu_kernels.KERNELS.module().add_rms_norm_fwd(
        x, residual, w, float(eps), rdt == torch.float32, float(offset), round_normed
    ))


def _rms_compiled_backward(dy, dresidual, h, rstd, weight, offset, need_w, eps):
    w = None if weight is None else weight.float().contiguous()
    dh, dw = _cpu_kernels.KERNELS.module().add_rms_norm_bwd(
        dy, dresidual, h, rstd, w, float(offset), False, need_w, float(eps)
    )
    return dh, (dw.to(weight.dtype) if need_w else h.new_empty(0))


add_rms_norm = torch.library.custom_op(f"{_common.OPS}::add_rms_norm", add_rms_norm_impl, mutates_args=())
add_rms_norm_backward = torch.library.custom_op(
    f"{_common.OPS}::add_rms_norm_backward", add_rms_norm_backward_impl, mutates_args=()
)
add_rms_norm.register_fake(_common.rms_fake_forward)
add_rms_norm_backward.register_fake(_common.rms_fake_backward)
_common.register_autograd(add_rms_norm, add_rms_norm_backward, rms=True)
add_rms_norm_eager = _common.eager_function(add_rms_norm_impl, add_rms_norm_backward_impl, rms=True)
