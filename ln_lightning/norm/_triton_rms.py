"""The ``triton`` backend for fused add + RMSNorm: forward and backward kernels.

Imported only when the Triton backend is used (never by ``import ln_lightning.norm`` without CUDA).
Same design as the LayerNorm kernels (:mod:`._triton_ops`, whose ``_cast`` helper is reused):

* Forward: one program per row; rows up to ``MAX_SINGLE_BLOCK`` wide in registers, wider rows
  (to 65536 and beyond) in blocks: a first pass sums ``h**2`` (a plain sum, no merge needed), a
  second re-reads the row (from L2) to normalise. Masked lanes load as 0, so they add nothing.
* float32 statistics and arithmetic whatever the input dtype (explicit upcasts).
* Backward: a fixed grid of programs, each owning a contiguous range of rows and accumulating its
  weight gradient in float32 into its own row of a partials buffer, reduced by ``torch.sum``. No
  atomics: bitwise deterministic for a given shape and device.
* The launch configuration is the pure function :func:`launch_config` (no autotuning); the
  runtime launches exactly the :class:`~._triton_ops.KernelLaunch` that :func:`plan_forward` /
  :func:`plan_backward` return, which ``benchmarks/triton_aot.py`` compiles ahead of time.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from . import _common
from ._triton_ops import KernelLaunch, LaunchConfig, _cast

MAX_SINGLE_BLOCK = 8192  # widest row held in registers; wider rows are processed in blocks
LOOP_BLOCK = 4096
BWD_PROGRAMS_PER_SM = 2
BWD_UNALIGNED_MAX_SINGLE_BLOCK = 4096  # the backward's widest register-held row whose width % 16 != 0

# ROUND codes: 0 none, 1 round n to x's dtype, 2 to the weight's (see _common.CAST_ORDERS).
_ROUND_NONE, _ROUND_X, _ROUND_W = 0, 1, 2


@triton.jit
def _weighted(n, W, cols, mask, offset, X_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr):
    if ROUND == 1:
        n = _cast(n, X_DTYPE).to(tl.float32)
    if ROUND == 2:
        n = _cast(n, W.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        n = n * (tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset)
    return n


@triton.jit
def _rms_fwd_kernel(
    X, R, W, Y, H, RSTD,
    stride_x, stride_r, stride_y, stride_h,
    N, eps, offset,
    HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    Y += row * stride_y
    if HAS_RESIDUAL:
        R += row * stride_r
    if STORE_H:
        H += row * stride_h
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_BLOCK:
        mask = cols < N
        h = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(R + cols, mask=mask, other=0.0).to(tl.float32)
        if STORE_H:
            h_stored = _cast(h, H.dtype.element_ty)
            tl.store(H + cols, h_stored, mask=mask)
            h = h_stored.to(tl.float32)  # normalise exactly the residual we return
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
        y = _weighted(h * rstd, W, cols, mask, offset, X.dtype.element_ty, HAS_WEIGHT, ROUND)
        tl.store(Y + cols, _cast(y, Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = c < N
            h = tl.load(X + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h += tl.load(R + c, mask=mask, other=0.0).to(tl.float32)
            if STORE_H:
                h_stored = _cast(h, H.dtype.element_ty)
                tl.store(H + c, h_stored, mask=mask)
                h = h_stored.to(tl.float32)
            acc += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = c < N
            if STORE_H:
                h = tl.load(H + c, mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(X + c, mask=mask, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    h += tl.load(R + c, mask=mask, other=0.0).to(tl.float32)
            y = _weighted(h * rstd, W, c, mask, offset, X.dtype.element_ty, HAS_WEIGHT, ROUND)
            tl.store(Y + c, _cast(y, Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_bwd_kernel(
    DY, DRES, H, W, RSTD, DH, DW_PART,
    stride_dy, stride_dres, stride_h, stride_dh,
    M, N, eps, rows_per_program, offset,
    HAS_DRES: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 row offsets: rows*N may pass 2**31
    row_end = tl.minimum(row_start + rows_per_program, M)
    cols = tl.arange(0, BLOCK_N)
    part = pid.to(tl.int64) * N
    if SINGLE_BLOCK:
        mask = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset
        dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for row in range(row_start, row_end):
            r64 = row
            h = tl.load(H + r64 * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + r64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_DRES:
                dres = tl.load(DRES + r64 * stride_dres + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + r64).to(tl.float32)
            n = h * rstd
            if HAS_WEIGHT:
                g = dy * w
            else:
                g = dy
            if NEED_DW:
                dw_acc += dy * n
            # _common.RMS_BACKWARD_FORM: dh = rstd * ((g - q n) + t q n), no cancellation along n; and, as in
            # the CPU kernel, q n = (sum(g h) / sum(h h)) h with the sums in float64 and g - q h as two fused
            # multiply-adds by q split into two floats, so that g - q n is rounded about once (issue 32)
            hd = h.to(tl.float64)
            shh = tl.sum(hd * hd, axis=0)
            q = tl.sum(g.to(tl.float64) * hd, axis=0) / tl.where(shh > 0, shh, 1.0)
            q_hi = q.to(tl.float32)
            q_lo = (q - q_hi.to(tl.float64)).to(tl.float32)
            t = eps * rstd * rstd
            perp = tl.fma(-q_lo, h, tl.fma(-q_hi, h, g))
            dh = tl.where(N == 1, (rstd * t) * g, (perp + (t * q_hi) * h) * rstd)  # width 1: all along n
            if HAS_DRES:
                dh += dres
            tl.store(DH + r64 * stride_dh + cols, _cast(dh, DH.dtype.element_ty), mask=mask)
        if NEED_DW:
            tl.store(DW_PART + part + cols, dw_acc, mask=mask)
    else:
        # The partials rows were zeroed by the host; each program only touches its own row.
        for row in range(row_start, row_end):
            r64 = row
            rstd = tl.load(RSTD + r64).to(tl.float32)
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            acc_nn = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                n = tl.load(H + r64 * stride_h + c, mask=mask, other=0.0).to(tl.float32) * rstd
                g = tl.load(DY + r64 * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    g = g * (tl.load(W + c, mask=mask, other=0.0).to(tl.float32) + offset)
                acc += g * n
                acc_nn += n * n
            # as in the single-block branch (rows this wide always have a perpendicular part)
            snn = tl.sum(acc_nn, axis=0)
            q = tl.sum(acc, axis=0) / tl.where(snn > 0, snn, 1.0)
            tq = eps * rstd * rstd * q
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                n = tl.load(H + r64 * stride_h + c, mask=mask, other=0.0).to(tl.float32) * rstd
                dy = tl.load(DY + r64 * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    g = dy * (tl.load(W + c, mask=mask, other=0.0).to(tl.float32) + offset)
                else:
                    g = dy
                dh = ((g - q * n) + tq * n) * rstd
                if HAS_DRES:
                    dh += tl.load(DRES + r64 * stride_dres + c, mask=mask, other=0.0).to(tl.float32)
                tl.store(DH + r64 * stride_dh + c, _cast(dh, DH.dtype.element_ty), mask=mask)
                if NEED_DW:
                    dw_old = tl.load(DW_PART + part + c, mask=mask, other=0.0)
                    tl.store(DW_PART + part + c, dw_old + dy * n, mask=mask)


def launch_config(n: int) -> tuple[int, bool, int]:
    """The forward's ``(BLOCK_N, single_block, num_warps)`` for a row width ``n``: a pure function of
    ``n`` (so an ahead-of-time compile check can enumerate it). The backward starts from it, see
    :func:`backward_launch_config`."""
    block = triton.next_power_of_2(max(n, 1))
    if block <= MAX_SINGLE_BLOCK:
        return block, True, 16 if block >= 8192 else 8 if block >= 2048 else 4
    return LOOP_BLOCK, False, 8


def forward_launch_config(n: int) -> LaunchConfig:
    """The forward kernel's launch for rows ``n`` wide (the runtime and the AOT check share it)."""
    block, single, warps = launch_config(n)
    return LaunchConfig(block, single, warps)


def backward_launch_config(n: int) -> LaunchConfig:
    """The backward kernel's launch for rows ``n`` wide (the runtime and the AOT check share it).

    Chosen from the compiled resources (``benchmarks/triton_aot.py --subset full``, sm_80/sm_90;
    README "Triton kernels compiled ahead of time"): the forward's launch spilled in the backward
    at block 1024 (4 warps), 2048 and 4096 (8 warps): 4 B per thread on sm_80 in some calls, at
    48-64 registers; 1024 now takes 8 warps, 2048 and 4096 16 (no spills on sm_80/sm_90).
    """
    block, single, warps = launch_config(n)
    if single and block > BWD_UNALIGNED_MAX_SINGLE_BLOCK and n % 16:
        # Widths that aren't a multiple of 16 get no 16-byte vector loads: past this block their
        # row does not fit in registers (56-168 B of spills at 8192, 16 warps), as in _triton_ops.
        return LaunchConfig(LOOP_BLOCK, False, 8)
    if single and block == 1024:
        warps = 8
    elif single and block in (2048, 4096):
        warps = 16
    return LaunchConfig(block, single, warps)


def _num_programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms * BWD_PROGRAMS_PER_SM))
    return max(1, min(rows, 4))  # the CPU interpreter: few programs, it runs them serially


def _round_code(x: Tensor, weight: Optional[Tensor], cast: str) -> int:
    rnd = _common.round_dtype(cast, x.dtype, None if weight is None else weight.dtype)
    if rnd is None:
        return _ROUND_NONE
    return _ROUND_X if rnd == x.dtype else _ROUND_W


def _check_triton_dtypes(*tensors: Optional[Tensor]) -> None:
    for t in tensors:
        if t is not None and t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"the Triton RMSNorm kernels take float32/float16/bfloat16, got {t.dtype}")


def plan_forward(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    eps: float,
    residual_in_fp32: bool,
    offset: float,
    cast: str,
) -> tuple[tuple[Tensor, Tensor, Tensor], Optional[KernelLaunch]]:
    """The forward's outputs ``(y, h, rstd)`` (allocated, not yet written) and its kernel launch
    (``None`` when there are no rows)."""
    _check_triton_dtypes(x, residual, weight)
    rows, n = x.shape
    stored = _common.stores_residual(x, residual, residual_in_fp32)
    rdt = _common.residual_dtype(x, residual, residual_in_fp32)
    ydt = _common.rms_output_dtype(cast, x.dtype, None if weight is None else weight.dtype)
    y = torch.empty((rows, n), dtype=ydt, device=x.device)
    h = torch.empty((rows, n), dtype=rdt, device=x.device) if stored else x.new_empty(0)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return (y, h, rstd), None
    config = forward_launch_config(n)
    # Absent operands get their own empty tensors (never dereferenced), as in _triton_ops.
    r_arg = residual if residual is not None else x.new_empty((0, n))
    h_arg = h if stored else y.new_empty((0, n))
    args = (
        x, r_arg, weight if weight is not None else x.new_empty(0), y, h_arg, rstd,
        x.stride(0), n, y.stride(0), n,
        n, eps, float(offset),
    )
    constexprs = dict(
        HAS_RESIDUAL=residual is not None, STORE_H=stored, HAS_WEIGHT=weight is not None,
        ROUND=_round_code(x, weight, cast),
        BLOCK_N=config.block_n, SINGLE_BLOCK=config.single_block,
    )
    return (y, h, rstd), KernelLaunch(_rms_fwd_kernel, (rows,), args, constexprs, config)


def triton_add_rms_norm_impl(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    eps: float,
    residual_in_fp32: bool,
    offset: float,
    cast: str,
) -> tuple[Tensor, Tensor, Tensor]:
    outputs, launch = plan_forward(x, residual, weight, eps, residual_in_fp32, offset, cast)
    if launch is not None:
        wrap_triton(launch.kernel)[launch.grid](*launch.args, **launch.kwargs())
    return outputs


def plan_backward(
    dy: Tensor,
    dresidual: Optional[Tensor],
    h: Tensor,
    rstd: Tensor,
    weight: Optional[Tensor],
    offset: float,
    need_weight_grad: bool,
    eps: float,
) -> tuple[tuple[Tensor, Tensor], Optional[KernelLaunch]]:
    """The backward's ``(dh, dweight_partials)`` (allocated, not yet written) and its kernel launch
    (``None`` when there are no rows)."""
    rows, n = h.shape
    need_w = need_weight_grad and weight is not None
    dh = torch.empty_like(h)
    programs = _num_programs(rows, h.device)
    config = backward_launch_config(n)
    # float32 partial sums, one row per program; the loop kernel accumulates into them.
    alloc = torch.empty if config.single_block else torch.zeros
    dw_part = alloc((programs, n), dtype=torch.float32, device=h.device) if need_w else h.new_empty(0, dtype=torch.float32)
    if rows == 0:
        return (dh, dw_part), None
    dres_arg = dresidual if dresidual is not None else dy.new_empty((0, n))
    args = (
        dy, dres_arg, h, weight if weight is not None else h.new_empty(0), rstd, dh, dw_part,
        dy.stride(0), n, h.stride(0), dh.stride(0),
        rows, n, float(eps), triton.cdiv(rows, programs), float(offset),
    )
    constexprs = dict(
        HAS_DRES=dresidual is not None, HAS_WEIGHT=weight is not None, NEED_DW=need_w,
        BLOCK_N=config.block_n, SINGLE_BLOCK=config.single_block,
    )
    return (dh, dw_part), KernelLaunch(_rms_bwd_kernel, (programs,), args, constexprs, config)


def triton_add_rms_norm_backward_impl(
    dy: Tensor,
    dresidual: Optional[Tensor],
    h: Tensor,
    rstd: Tensor,
    weight: Optional[Tensor],
    offset: float,
    need_weight_grad: bool,
    eps: float,
) -> tuple[Tensor, Tensor]:
    (dh, dw_part), launch = plan_backward(dy, dresidual, h, rstd, weight, offset, need_weight_grad, eps)
    if launch is not None:
        wrap_triton(launch.kernel)[launch.grid](*launch.args, **launch.kwargs())
    else:  # no rows: the partials must read as zero
        dw_part.zero_()
    need_w = need_weight_grad and weight is not None
    dw = dw_part.sum(0).to(weight.dtype) if need_w else h.new_empty(0)
    return dh, dw


triton_add_rms_norm = triton_op(f"{_common.OPS}::triton_add_rms_norm", triton_add_rms_norm_impl, mutates_args=())
triton_add_rms_norm_backward = triton_op(
    f"{_common.OPS}::triton_add_rms_norm_backward", triton_add_rms_norm_backward_impl, mutates_args=()
)
_common.register_autograd(triton_add_rms_norm, triton_add_rms_norm_backward, rms=True)
triton_add_rms_norm_eager = _common.eager_function(triton_add_rms_norm_impl, triton_add_rms_norm_backward_impl, rms=True)
