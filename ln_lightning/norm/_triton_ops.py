"""The ``triton`` backend: LayerNorm (+ fused residual add) forward and backward kernels.

Imported only when the Triton backend is used (never by ``import ln_lightning.norm`` without CUDA).

Design:
* Forward: one program per row. Rows up to ``MAX_SINGLE_BLOCK`` wide are held in registers
  (one read of ``x``/``residual``); wider rows (up to 65536 and beyond) are read in blocks with
  Chan's parallel-variance merge for the statistics, then re-read (from L2) to normalise.
  Masked lanes are loaded as 0 *and* excluded from the centred sum of squares, so a
  non-power-of-two width never pollutes the variance.
* Statistics, sums and the normalisation run in float32 whatever the input dtype (explicit
  upcasts; the Triton CPU interpreter computes bf16 arithmetic wrongly without them).
  ``rstd`` is ``1 / sqrt(var + eps)`` (``libdevice.rsqrt`` does not run in the interpreter).
* Backward: a fixed grid of programs, each owning a contiguous range of rows; each program
  accumulates its rows' weight/bias gradients in float32 into its own row of a partials buffer,
  which ``torch.sum`` then reduces. No atomics: the result is bitwise deterministic for a given
  shape and device. The downstream gradient of the new residual is added to ``dx`` in the same pass.
  Rows are held in registers up to 8192 wide when the width is a multiple of 16, up to 4096
  otherwise (unvectorised loads need about twice the registers); wider rows loop over blocks.
* Launch parameters (block, warps) come from :func:`forward_launch_config` /
  :func:`backward_launch_config`, chosen from the compiled resource usage that
  ``benchmarks/triton_aot.py`` reports for sm_80/sm_90/sm_100 (no spills, occupancy stated).
* No autotuning (deterministic launch parameters; the interpreter rejects multi-config autotune).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from . import _common

MAX_SINGLE_BLOCK = 8192  # widest row held in registers; wider rows are processed in blocks
LOOP_BLOCK = 4096
# Launch tunables (module attributes so a GPU session can sweep them, see
# benchmarks/gpu_norm_check.py): backward programs per SM, and a num_warps override (0 = by width).
BWD_PROGRAMS_PER_SM = 2
FWD_NUM_WARPS = 0
BWD_NUM_WARPS = 0
BWD_NUM_STAGES = 0  # 0: Triton's default software-pipelining depth for the row loop
BWD_UNALIGNED_MAX_SINGLE_BLOCK = 4096  # the backward's widest register-held row whose width % 16 != 0
# The module attributes above that decide launches (benchmarks/triton_aot.py --set overrides them).
LAUNCH_TUNABLES = (
    "MAX_SINGLE_BLOCK", "LOOP_BLOCK", "BWD_PROGRAMS_PER_SM", "FWD_NUM_WARPS", "BWD_NUM_WARPS", "BWD_NUM_STAGES",
    "BWD_UNALIGNED_MAX_SINGLE_BLOCK",
)


@triton.jit
def _cast(v, dtype: tl.constexpr):
    """``v.to(dtype)`` with round-to-nearest-even also for bfloat16.

    Compiled Triton already rounds to nearest; the CPU interpreter truncates float32 -> bfloat16,
    which would leave outputs 1 ulp off. Rounding the float32 bits first makes the final cast
    exact in both (NaN is passed through untouched).
    """
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    return v.to(dtype)


@triton.jit
def _fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    stride_x, stride_r, stride_y, stride_h,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
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
    # Statistics are taken of h - shift, shift = the row's first element: exact zeros for a
    # constant row (so its output is exactly the bias) and less cancellation for large offsets.
    shift = tl.load(X).to(tl.float32)
    if HAS_RESIDUAL:
        shift += tl.load(R).to(tl.float32)
    if STORE_H:
        shift = _cast(shift, H.dtype.element_ty).to(tl.float32)
    if SINGLE_BLOCK:
        mask = cols < N
        h = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(R + cols, mask=mask, other=0.0).to(tl.float32)
        if STORE_H:
            h_stored = _cast(h, H.dtype.element_ty)
            tl.store(H + cols, h_stored, mask=mask)
            h = h_stored.to(tl.float32)  # normalise exactly the residual we return
        # weight/bias loads issued before the reductions so their latency overlaps them
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, h - shift, 0.0)
        mean_d = tl.sum(d, axis=0) / N
        hc = tl.where(mask, d - mean_d, 0.0)
        var = tl.sum(hc * hc, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        y = hc * rstd
        if HAS_WEIGHT:
            y = y * w
        if HAS_BIAS:
            y = y + b
        tl.store(Y + cols, _cast(y, Y.dtype.element_ty), mask=mask)
    else:
        mean_d = tl.zeros((), dtype=tl.float32)  # mean of h - shift
        m2 = tl.zeros((), dtype=tl.float32)
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
            # (plain arithmetic, no .to(): the interpreter hands loop indices over as Python ints)
            n_a = start + 0.0
            n_b = tl.minimum(N - start, BLOCK_N) + 0.0
            d = tl.where(mask, h - shift, 0.0)
            mean_b = tl.sum(d, axis=0) / n_b
            hc = tl.where(mask, d - mean_b, 0.0)
            m2_b = tl.sum(hc * hc, axis=0)
            n = n_a + n_b
            delta = mean_b - mean_d
            mean_d = mean_d + delta * (n_b / n)  # Chan et al.: exact merge of block statistics
            m2 = m2 + m2_b + delta * delta * (n_a * n_b / n)
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = c < N
            if STORE_H:
                h = tl.load(H + c, mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(X + c, mask=mask, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    h += tl.load(R + c, mask=mask, other=0.0).to(tl.float32)
            y = ((h - shift) - mean_d) * rstd
            if HAS_WEIGHT:
                y = y * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(B + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + c, _cast(y, Y.dtype.element_ty), mask=mask)
    # MEAN holds the mean of h - h[0] (see the op docstring): the backward re-derives
    # h - mean as (h - h[0]) - mean_d, which keeps full precision at large offsets where a
    # float32 absolute mean (1e4 + x) would be rounded to 1e-3.
    tl.store(MEAN + row, mean_d)
    tl.store(RSTD + row, rstd)


@triton.jit
def _bwd_kernel(
    DY, DRES, H, W, MEAN, RSTD, DH, DW_PART, DB_PART,
    stride_dy, stride_dres, stride_h, stride_dh,
    M, N, eps, rows_per_program,
    HAS_DRES: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
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
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for row in range(row_start, row_end):
            r64 = row
            h = tl.load(H + r64 * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + r64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_DRES:  # issued with the other loads: its latency overlaps the reductions
                dres = tl.load(DRES + r64 * stride_dres + cols, mask=mask, other=0.0).to(tl.float32)
            mean_d = tl.load(MEAN + r64).to(tl.float32)
            shift = tl.load(H + r64 * stride_h).to(tl.float32)
            rstd = tl.load(RSTD + r64).to(tl.float32)
            xhat = tl.where(mask, ((h - shift) - mean_d) * rstd, 0.0)
            if HAS_WEIGHT:
                wdy = dy * w
            else:
                wdy = dy
            if NEED_DW:
                dw_acc += dy * xhat
            if NEED_DB:
                db_acc += dy
            # _common.BACKWARD_FORM: dh = rstd * ((g - c2 - q x_hat) + t q x_hat), no cancellation along x_hat
            sxx = tl.sum(xhat * xhat, axis=0)
            q = tl.sum(xhat * wdy, axis=0) / tl.where(sxx > 0, sxx, 1.0)
            c2 = tl.sum(wdy, axis=0) / N
            t = eps * rstd * rstd
            # width 2: g - c2 is all along x_hat (a constant row has t = 1)
            dh = tl.where(N == 2, (rstd * t) * (wdy - c2), (((wdy - c2) - q * xhat) + (t * q) * xhat) * rstd)
            if HAS_DRES:
                dh += dres
            tl.store(DH + r64 * stride_dh + cols, _cast(dh, DH.dtype.element_ty), mask=mask)
        if NEED_DW:
            tl.store(DW_PART + part + cols, dw_acc, mask=mask)
        if NEED_DB:
            tl.store(DB_PART + part + cols, db_acc, mask=mask)
    else:
        # The partials rows were zeroed by the host; each program only touches its own row.
        for row in range(row_start, row_end):
            r64 = row
            mean_d = tl.load(MEAN + r64).to(tl.float32)
            shift = tl.load(H + r64 * stride_h).to(tl.float32)
            rstd = tl.load(RSTD + r64).to(tl.float32)
            acc1 = tl.zeros((), dtype=tl.float32)
            acc2 = tl.zeros((), dtype=tl.float32)
            acc3 = tl.zeros((), dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                h = tl.load(H + r64 * stride_h + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + r64 * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, ((h - shift) - mean_d) * rstd, 0.0)
                if HAS_WEIGHT:
                    wdy = dy * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                else:
                    wdy = dy
                acc1 += tl.sum(xhat * wdy, axis=0)
                acc2 += tl.sum(wdy, axis=0)
                acc3 += tl.sum(xhat * xhat, axis=0)
            # as in the single-block branch (rows this wide always have a perpendicular part)
            q = acc1 / tl.where(acc3 > 0, acc3, 1.0)
            c2 = acc2 / N
            tq = eps * rstd * rstd * q
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                h = tl.load(H + r64 * stride_h + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + r64 * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, ((h - shift) - mean_d) * rstd, 0.0)
                if HAS_WEIGHT:
                    wdy = dy * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                else:
                    wdy = dy
                dh = (((wdy - c2) - q * xhat) + tq * xhat) * rstd
                if HAS_DRES:
                    dh += tl.load(DRES + r64 * stride_dres + c, mask=mask, other=0.0).to(tl.float32)
                tl.store(DH + r64 * stride_dh + c, _cast(dh, DH.dtype.element_ty), mask=mask)
                if NEED_DW:
                    dw_old = tl.load(DW_PART + part + c, mask=mask, other=0.0)
                    tl.store(DW_PART + part + c, dw_old + dy * xhat, mask=mask)
                if NEED_DB:
                    db_old = tl.load(DB_PART + part + c, mask=mask, other=0.0)
                    tl.store(DB_PART + part + c, db_old + dy, mask=mask)


@dataclass(frozen=True)
class LaunchConfig:
    """How a kernel is compiled and launched for one row width (a "width bucket")."""

    block_n: int  # BLOCK_N: the row (single_block) or the loop's block, a power of two
    single_block: bool  # the whole row is held in registers
    num_warps: int
    num_stages: int = 0  # 0: Triton's default software-pipelining depth

    def options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, **({"num_stages": self.num_stages} if self.num_stages else {})}


def _width_bucket(n_cols: int) -> tuple[int, bool]:
    block = triton.next_power_of_2(max(n_cols, 1))
    if block <= MAX_SINGLE_BLOCK:
        return block, True
    return LOOP_BLOCK, False


def forward_launch_config(n_cols: int) -> LaunchConfig:
    """The forward kernel's launch for rows ``n_cols`` wide (the runtime and the AOT check share it)."""
    block, single = _width_bucket(n_cols)
    # Liger-Kernel's width heuristic (known-good on H100); GPU sessions can sweep it.
    warps = (16 if block >= 8192 else 8 if block >= 2048 else 4) if single else 8
    return LaunchConfig(block, single, FWD_NUM_WARPS or warps)


def backward_launch_config(n_cols: int) -> LaunchConfig:
    """The backward kernel's launch for rows ``n_cols`` wide (the runtime and the AOT check share it).

    Chosen from the compiled resources (``benchmarks/triton_aot.py --subset full``, sm_80/sm_90;
    README "Triton kernels compiled ahead of time"): the backward keeps about six row-sized float32
    values per element live, so at 4096 it takes 32 warps (at most 63 registers, 50% occupancy; 8
    warps needed up to 208, 12%, and spilled once), and at 8192 16 warps (0 spills for widths that
    are multiples of 16; 32 warps spill). The loop kernel takes 4 warps: 8 and 16 spilled a few
    bytes in one variant each under Triton's ptxas flags, and with 4 every variant still keeps
    ``BWD_PROGRAMS_PER_SM`` blocks resident; the bytes in flight per program are set by the block,
    not the warps.
    """
    block, single = _width_bucket(n_cols)
    if single and block > BWD_UNALIGNED_MAX_SINGLE_BLOCK and n_cols % 16:
        # Widths that aren't a multiple of 16 get no 16-byte vector loads (one address per element):
        # past this block their row does not fit in registers (spills at 16 and 32 warps).
        block, single = LOOP_BLOCK, False
    if not single:
        warps = 4
    else:
        warps = 32 if block == 4096 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return LaunchConfig(block, single, BWD_NUM_WARPS or warps, BWD_NUM_STAGES)


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch, fully decided but not run: what the runtime launches and the AOT check
    (benchmarks/triton_aot.py) compiles for named GPU targets."""

    kernel: triton.runtime.JITFunction
    grid: tuple[int, ...]
    args: tuple  # the runtime arguments, in the kernel's order
    constexprs: dict[str, Any]
    config: LaunchConfig

    def kwargs(self) -> dict[str, Any]:
        return {**self.constexprs, **self.config.options()}


def _num_programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms * BWD_PROGRAMS_PER_SM))
    return max(1, min(rows, 4))  # the CPU interpreter: few programs, it runs them serially


def _check_triton_dtypes(*tensors: Optional[Tensor]) -> None:
    for t in tensors:
        if t is not None and t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"the Triton LayerNorm kernels take float32/float16/bfloat16, got {t.dtype}")


def plan_forward(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    residual_in_fp32: bool,
    y_fp32: bool,
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Optional[KernelLaunch]]:
    """The forward's outputs ``(y, h, mean, rstd)`` (allocated, not yet written) and its kernel
    launch (``None`` when there are no rows)."""
    _check_triton_dtypes(x, residual)
    rows, n = x.shape
    stored = _common.stores_residual(x, residual, residual_in_fp32)
    rdt = _common.residual_dtype(x, residual, residual_in_fp32)
    y = torch.empty((rows, n), dtype=_common.output_dtype(x, y_fp32), device=x.device)
    h = torch.empty((rows, n), dtype=rdt, device=x.device) if stored else x.new_empty(0)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return (y, h, mean, rstd), None
    config = forward_launch_config(n)
    # Absent operands get their own empty tensors (never dereferenced): aliasing real ones would
    # confuse torch.compile's analysis of what the kernel reads and writes.
    r_arg = residual if residual is not None else x.new_empty((0, n))
    h_arg = h if stored else y.new_empty((0, n))
    args = (
        x, r_arg, weight if weight is not None else x.new_empty(0), bias if bias is not None else x.new_empty(0),
        y, h_arg, mean, rstd,
        x.stride(0), n, y.stride(0), n,
        n, eps,
    )
    constexprs = dict(
        HAS_RESIDUAL=residual is not None, STORE_H=stored,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n, SINGLE_BLOCK=config.single_block,
    )
    return (y, h, mean, rstd), KernelLaunch(_fwd_kernel, (rows,), args, constexprs, config)


def triton_add_layer_norm_impl(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    residual_in_fp32: bool,
    y_fp32: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    outputs, launch = plan_forward(x, residual, weight, bias, eps, residual_in_fp32, y_fp32)
    if launch is not None:
        wrap_triton(launch.kernel)[launch.grid](*launch.args, **launch.kwargs())
    return outputs


def plan_backward(
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
) -> tuple[tuple[Tensor, Tensor, Tensor], Optional[KernelLaunch]]:
    """The backward's ``(dh, dweight_partials, dbias_partials)`` (allocated, not yet written) and
    its kernel launch (``None`` when there are no rows)."""
    rows, n = h.shape
    need_w = need_weight_grad and weight is not None
    need_b = need_bias_grad and bias is not None
    dh = torch.empty_like(h)
    programs = _num_programs(rows, h.device)
    config = backward_launch_config(n)
    # float32 partial sums, one row per program; the loop kernel accumulates into them.
    alloc = torch.empty if config.single_block else torch.zeros
    dw_part = alloc((programs, n), dtype=torch.float32, device=h.device) if need_w else h.new_empty(0, dtype=torch.float32)
    db_part = alloc((programs, n), dtype=torch.float32, device=h.device) if need_b else h.new_empty(0, dtype=torch.float32)
    if rows == 0:
        return (dh, dw_part, db_part), None
    rows_per_program = triton.cdiv(rows, programs)
    dres_arg = dresidual if dresidual is not None else dy.new_empty((0, n))
    args = (
        dy, dres_arg, h, weight if weight is not None else h.new_empty(0), mean, rstd,
        dh, dw_part, db_part,
        dy.stride(0), n, h.stride(0), dh.stride(0),
        rows, n, float(eps), rows_per_program,
    )
    constexprs = dict(
        HAS_DRES=dresidual is not None, HAS_WEIGHT=weight is not None,
        NEED_DW=need_w, NEED_DB=need_b,
        BLOCK_N=config.block_n, SINGLE_BLOCK=config.single_block,
    )
    return (dh, dw_part, db_part), KernelLaunch(_bwd_kernel, (programs,), args, constexprs, config)


def triton_add_layer_norm_backward_impl(
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
    (dh, dw_part, db_part), launch = plan_backward(
        dy, dresidual, h, mean, rstd, weight, bias, need_weight_grad, need_bias_grad, eps
    )
    if launch is not None:
        wrap_triton(launch.kernel)[launch.grid](*launch.args, **launch.kwargs())
    else:  # no rows: the partials must read as zero
        dw_part.zero_()
        db_part.zero_()
    need_w = need_weight_grad and weight is not None
    need_b = need_bias_grad and bias is not None
    dw = dw_part.sum(0).to(weight.dtype) if need_w else h.new_empty(0)
    db = db_part.sum(0).to(bias.dtype) if need_b else h.new_empty(0)
    return dh, dw, db


# triton_op: torch.compile sees through to the kernels (and uses the impl as the fake kernel).
triton_add_layer_norm = triton_op(f"{_common.OPS}::triton_add_layer_norm", triton_add_layer_norm_impl, mutates_args=())
triton_add_layer_norm_backward = triton_op(
    f"{_common.OPS}::triton_add_layer_norm_backward", triton_add_layer_norm_backward_impl, mutates_args=()
)
_common.register_autograd(triton_add_layer_norm, triton_add_layer_norm_backward)
triton_add_layer_norm_eager = _common.eager_function(triton_add_layer_norm_impl, triton_add_layer_norm_backward_impl)
