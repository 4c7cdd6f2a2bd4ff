"""The ``triton`` backend of both norms: fused residual add + LayerNorm or RMSNorm, forward and backward.

Imported only when the Triton backend is used (never by ``import ln_lightning.norm`` without CUDA).
One forward and one backward kernel serve both norms, switched by the ``IS_RMS_NORM`` constexpr (as
flash-attn's ``ops/triton/layer_norm.py``): each kind compiles to its own binary, so the flag costs
nothing at run time; what differs is the statistics, the input-gradient formula and the weight
(RMSNorm's ``offset + w`` and cast order, LayerNorm's bias).

Design:
* Forward: one program per row. Rows up to ``MAX_SINGLE_BLOCK`` wide are held in registers
  (one read of ``x``/``residual``); wider rows (up to 65536 and beyond) are read in blocks, then
  re-read (from L2) to normalise. LayerNorm merges the blocks' statistics with Chan's parallel
  variance; RMSNorm sums ``h**2`` (a plain sum, no merge needed). Masked lanes are loaded as 0 *and*
  excluded from LayerNorm's centred sum of squares, so a non-power-of-two width never pollutes it.
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

# ROUND codes (RMSNorm's cast order, see _common.CAST_ORDERS): 0 none, 1 round n to x's dtype, 2 to the weight's.
_ROUND_NONE, _ROUND_X, _ROUND_W = 0, 1, 2


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
def _stream(X, R, H, c, mask, HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr):
    """``h = x + residual`` for the columns ``c`` in float32, stored when asked; returns exactly
    the stored value (the residual returned is the one normalised)."""
    h = tl.load(X + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(R + c, mask=mask, other=0.0).to(tl.float32)
    if STORE_H:
        h_stored = _cast(h, H.dtype.element_ty)
        tl.store(H + c, h_stored, mask=mask)
        h = h_stored.to(tl.float32)
    return h


@triton.jit
def _weight(W, c, mask, offset, IS_RMS_NORM: tl.constexpr):
    """The weight as float32: RMSNorm applies ``offset + w`` (Gemma's ``1 + w``)."""
    w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS_NORM:
        w = w + offset
    return w


@triton.jit
def _round(n, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, ROUND: tl.constexpr):
    """RMSNorm's cast order: ``n`` rounded to x's or the weight's dtype before the weight multiply."""
    if ROUND == 1:
        n = _cast(n, X_DTYPE).to(tl.float32)
    if ROUND == 2:
        n = _cast(n, W_DTYPE).to(tl.float32)
    return n


@triton.jit
def _fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    stride_x, stride_r, stride_y, stride_h,
    N, eps, offset,
    IS_RMS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ROUND: tl.constexpr,
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
    if not IS_RMS_NORM:
        # Statistics are taken of h - shift, shift = the row's first element: exact zeros for a
        # constant row (so its output is exactly the bias) and less cancellation for large offsets.
        shift = tl.load(X).to(tl.float32)
        if HAS_RESIDUAL:
            shift += tl.load(R).to(tl.float32)
        if STORE_H:
            shift = _cast(shift, H.dtype.element_ty).to(tl.float32)
    if SINGLE_BLOCK:
        mask = cols < N
        h = _stream(X, R, H, cols, mask, HAS_RESIDUAL, STORE_H)
        if IS_RMS_NORM:
            # the weight is loaded after the reduction: loaded before it (as LayerNorm's), it held 4-12 more
            # registers, and the 4096/8192 buckets lost a quarter of their occupancy (AOT, sm_90)
            rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
            y = _round(h * rstd, X.dtype.element_ty, W.dtype.element_ty, ROUND)
            if HAS_WEIGHT:
                w = _weight(W, cols, mask, offset, IS_RMS_NORM)
        else:
            # weight/bias loads issued before the reductions so their latency overlaps them
            if HAS_WEIGHT:
                w = _weight(W, cols, mask, offset, IS_RMS_NORM)
            if HAS_BIAS:
                b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, h - shift, 0.0)
            mean_d = tl.sum(d, axis=0) / N
            hc = tl.where(mask, d - mean_d, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(hc * hc, axis=0) / N + eps)
            y = hc * rstd
        if HAS_WEIGHT:
            y = y * w
        if HAS_BIAS:
            y = y + b
        tl.store(Y + cols, _cast(y, Y.dtype.element_ty), mask=mask)
    else:
        if IS_RMS_NORM:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        else:
            mean_d = tl.zeros((), dtype=tl.float32)  # mean of h - shift
            m2 = tl.zeros((), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = c < N
            h = _stream(X, R, H, c, mask, HAS_RESIDUAL, STORE_H)
            if IS_RMS_NORM:
                acc += h * h
            else:
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
        if IS_RMS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        else:
            rstd = 1.0 / tl.sqrt(m2 / N + eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = c < N
            if STORE_H:
                h = tl.load(H + c, mask=mask, other=0.0).to(tl.float32)
            else:
                h = _stream(X, R, H, c, mask, HAS_RESIDUAL, False)
            if IS_RMS_NORM:
                y = _round(h * rstd, X.dtype.element_ty, W.dtype.element_ty, ROUND)
            else:
                y = ((h - shift) - mean_d) * rstd
            if HAS_WEIGHT:
                y = y * _weight(W, c, mask, offset, IS_RMS_NORM)
            if HAS_BIAS:
                y = y + tl.load(B + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + c, _cast(y, Y.dtype.element_ty), mask=mask)
    if not IS_RMS_NORM:
        # MEAN holds the mean of h - h[0] (see _common): the backward re-derives h - mean as
        # (h - h[0]) - mean_d, which keeps full precision at large offsets where a float32
        # absolute mean (1e4 + x) would be rounded to 1e-3.
        tl.store(MEAN + row, mean_d)
    tl.store(RSTD + row, rstd)


@triton.jit
def _row_stats(H_ROW, MEAN_ROW, IS_RMS_NORM: tl.constexpr):
    """LayerNorm's ``(h[0], mean of h - h[0])`` for a row: the shift and mean its forward stored (RMSNorm: unused zeros)."""
    if IS_RMS_NORM:
        shift = tl.zeros((), dtype=tl.float32)
        mean_d = tl.zeros((), dtype=tl.float32)
    else:
        mean_d = tl.load(MEAN_ROW).to(tl.float32)
        shift = tl.load(H_ROW).to(tl.float32)
    return shift, mean_d


@triton.jit
def _normed(h, shift, mean_d, rstd, mask, IS_RMS_NORM: tl.constexpr):
    """x_hat from the stored statistics: ``h * rstd`` (RMSNorm; masked lanes load as 0), or
    ``((h - h[0]) - mean_d) * rstd`` (LayerNorm, see the forward's MEAN; masked lanes zeroed)."""
    if IS_RMS_NORM:
        xhat = h * rstd
    else:
        xhat = tl.where(mask, ((h - shift) - mean_d) * rstd, 0.0)
    return xhat


@triton.jit
def _block(H_ROW, DY_ROW, W, c, mask, shift, mean_d, rstd, offset, IS_RMS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """``(x_hat, dy, g = dy * w)`` for the columns ``c`` of a row (the backward's row loop; x_hat is taken
    before the gradient is loaded: the other order held up to 21 more registers, AOT sm_90)."""
    xhat = _normed(tl.load(H_ROW + c, mask=mask, other=0.0).to(tl.float32), shift, mean_d, rstd, mask, IS_RMS_NORM)
    dy = tl.load(DY_ROW + c, mask=mask, other=0.0).to(tl.float32)
    g = dy
    if HAS_WEIGHT:
        g = dy * _weight(W, c, mask, offset, IS_RMS_NORM)
    return xhat, dy, g


@triton.jit
def _layer_norm_dh(g, xhat, rstd, N, eps):
    """_common.BACKWARD_FORM: dh = rstd * ((g - c2 - q x_hat) + t q x_hat), no cancellation along x_hat."""
    sxx = tl.sum(xhat * xhat, axis=0)
    q = tl.sum(xhat * g, axis=0) / tl.where(sxx > 0, sxx, 1.0)
    c2 = tl.sum(g, axis=0) / N
    t = eps * rstd * rstd
    # width 2: g - c2 is all along x_hat (a constant row has t = 1)
    return tl.where(N == 2, (rstd * t) * (g - c2), (((g - c2) - q * xhat) + (t * q) * xhat) * rstd)


@triton.jit
def _rms_norm_dh(g, h, rstd, N, eps):
    """_common.RMS_BACKWARD_FORM: dh = rstd * ((g - q n) + t q n), no cancellation along n; and, as in
    the CPU kernel, q n = (sum(g h) / sum(h h)) h with the sums in float64 and g - q h as two fused
    multiply-adds by q split into two floats, so that g - q n is rounded about once (issue 32)."""
    hd = h.to(tl.float64)
    shh = tl.sum(hd * hd, axis=0)
    q = tl.sum(g.to(tl.float64) * hd, axis=0) / tl.where(shh > 0, shh, 1.0)
    q_hi = q.to(tl.float32)
    q_lo = (q - q_hi.to(tl.float64)).to(tl.float32)
    t = eps * rstd * rstd
    perp = tl.fma(-q_lo, h, tl.fma(-q_hi, h, g))
    return tl.where(N == 1, (rstd * t) * g, (perp + (t * q_hi) * h) * rstd)  # width 1: all along n


@triton.jit
def _bwd_kernel(
    DY, DRES, H, W, MEAN, RSTD, DH, DW_PART, DB_PART,
    stride_dy, stride_dres, stride_h, stride_dh,
    M, N, eps, offset, rows_per_program,
    IS_RMS_NORM: tl.constexpr, HAS_DRES: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
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
            w = _weight(W, cols, mask, offset, IS_RMS_NORM)
        dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for row in range(row_start, row_end):
            r64 = row
            h = tl.load(H + r64 * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + r64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_DRES:  # issued with the other loads: its latency overlaps the reductions
                dres = tl.load(DRES + r64 * stride_dres + cols, mask=mask, other=0.0).to(tl.float32)
            shift, mean_d = _row_stats(H + r64 * stride_h, MEAN + r64, IS_RMS_NORM)
            rstd = tl.load(RSTD + r64).to(tl.float32)
            xhat = _normed(h, shift, mean_d, rstd, mask, IS_RMS_NORM)
            if HAS_WEIGHT:
                g = dy * w
            else:
                g = dy
            if NEED_DW:
                dw_acc += dy * xhat
            if NEED_DB:
                db_acc += dy
            if IS_RMS_NORM:
                dh = _rms_norm_dh(g, h, rstd, N, eps)
            else:
                dh = _layer_norm_dh(g, xhat, rstd, N, eps)
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
            rstd = tl.load(RSTD + r64).to(tl.float32)
            shift, mean_d = _row_stats(H + r64 * stride_h, MEAN + r64, IS_RMS_NORM)
            if IS_RMS_NORM:
                acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
                acc_nn = tl.zeros((BLOCK_N,), dtype=tl.float32)
            else:
                acc1 = tl.zeros((), dtype=tl.float32)
                acc2 = tl.zeros((), dtype=tl.float32)
                acc3 = tl.zeros((), dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                xhat, _dy, g = _block(H + r64 * stride_h, DY + r64 * stride_dy, W, c, mask, shift, mean_d, rstd, offset,
                                      IS_RMS_NORM, HAS_WEIGHT)
                if IS_RMS_NORM:
                    acc += g * xhat
                    acc_nn += xhat * xhat
                else:
                    acc1 += tl.sum(xhat * g, axis=0)
                    acc2 += tl.sum(g, axis=0)
                    acc3 += tl.sum(xhat * xhat, axis=0)
            # the forms of _layer_norm_dh / _rms_norm_dh (rows this wide always have a perpendicular
            # part); RMSNorm has no mean to subtract (c2 = 0 leaves g exactly as it is)
            if IS_RMS_NORM:
                snn = tl.sum(acc_nn, axis=0)
                q = tl.sum(acc, axis=0) / tl.where(snn > 0, snn, 1.0)
                c2 = 0.0
            else:
                q = acc1 / tl.where(acc3 > 0, acc3, 1.0)
                c2 = acc2 / N
            tq = eps * rstd * rstd * q
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                xhat, dy, g = _block(H + r64 * stride_h, DY + r64 * stride_dy, W, c, mask, shift, mean_d, rstd, offset,
                                     IS_RMS_NORM, HAS_WEIGHT)
                dh = (((g - c2) - q * xhat) + tq * xhat) * rstd
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
    """The forward kernel's launch for rows ``n_cols`` wide, either norm (the runtime and the AOT check share it)."""
    block, single = _width_bucket(n_cols)
    # Liger-Kernel's width heuristic (known-good on H100); GPU sessions can sweep it.
    warps = (16 if block >= 8192 else 8 if block >= 2048 else 4) if single else 8
    return LaunchConfig(block, single, FWD_NUM_WARPS or warps)


def _backward_warps(block: int, single: bool, rms: bool) -> int:
    """The backward's warps, per kind: the binaries differ, so each kind's table comes from its own
    compiled resources (benchmarks/triton_aot.py --subset full, sm_80/sm_90; README "Triton kernels
    compiled ahead of time").

    LayerNorm keeps about six row-sized float32 values per element live: 32 warps at 4096 (at most 63
    registers, 50% occupancy; 8 needed up to 208, 12%, and spilled once), 16 at 8192 (32 spill); its
    loop kernel takes 4 (8 and 16 spilled a few bytes in one variant each; with 4 every variant still
    keeps BWD_PROGRAMS_PER_SM blocks resident, the bytes in flight are set by the block). RMSNorm
    spilled at the forward's warps at 1024 (4), 2048 and 4096 (8): 4 B per thread on sm_80 at 48-64
    registers; 8 and 16 do not.
    """
    if not single:
        return 8 if rms else 4
    if rms:
        return 16 if block >= 2048 else 8 if block == 1024 else 4
    return 32 if block == 4096 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def backward_launch_config(n_cols: int, rms: bool = False) -> LaunchConfig:
    """The backward kernel's launch for rows ``n_cols`` wide (the runtime and the AOT check share it)."""
    block, single = _width_bucket(n_cols)
    if single and block > BWD_UNALIGNED_MAX_SINGLE_BLOCK and n_cols % 16:
        # Widths that aren't a multiple of 16 get no 16-byte vector loads (one address per element):
        # past this block their row does not fit in registers (spills at 16 and 32 warps).
        block, single = LOOP_BLOCK, False
    return LaunchConfig(block, single, BWD_NUM_WARPS or _backward_warps(block, single, rms), BWD_NUM_STAGES)


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

    def run(self) -> None:
        wrap_triton(self.kernel)[self.grid](*self.args, **self.kwargs())


def _num_programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms * BWD_PROGRAMS_PER_SM))
    return max(1, min(rows, 4))  # the CPU interpreter: few programs, it runs them serially


def _check_triton_dtypes(rms: bool, *tensors: Optional[Tensor]) -> None:
    for t in tensors:
        if t is not None and t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            # one literal message per norm: docs/troubleshooting.yml groups them by their text
            if rms:
                raise TypeError(f"the Triton RMSNorm kernels take float32/float16/bfloat16, got {t.dtype}")
            raise TypeError(f"the Triton LayerNorm kernels take float32/float16/bfloat16, got {t.dtype}")


def _round_code(x: Tensor, weight: Optional[Tensor], cast: str) -> int:
    rnd = _common.round_dtype(cast, x.dtype, None if weight is None else weight.dtype)
    if rnd is None:
        return _ROUND_NONE
    return _ROUND_X if rnd == x.dtype else _ROUND_W


def _plan_forward(x, residual, weight, bias, eps, residual_in_fp32, ydt, rms, offset, round_code):
    """Both norms' forward: ``(y, h, mean, rstd)`` allocated (``mean`` empty for RMSNorm) and the launch."""
    rows, n = x.shape
    stored = _common.stores_residual(x, residual, residual_in_fp32)
    rdt = _common.residual_dtype(x, residual, residual_in_fp32)
    y = torch.empty((rows, n), dtype=ydt, device=x.device)
    h = torch.empty((rows, n), dtype=rdt, device=x.device) if stored else x.new_empty(0)
    mean = x.new_empty(0, dtype=torch.float32) if rms else torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return (y, h, mean, rstd), None
    config = forward_launch_config(n)
    # Absent operands get their own empty tensors (never dereferenced): aliasing real ones would
    # confuse torch.compile's analysis of what the kernel reads and writes.
    args = (
        x, residual if residual is not None else x.new_empty((0, n)),
        weight if weight is not None else x.new_empty(0), bias if bias is not None else x.new_empty(0),
        y, h if stored else y.new_empty((0, n)), mean, rstd,
        x.stride(0), n, y.stride(0), n,
        n, eps, float(offset),
    )
    constexprs = dict(
        IS_RMS_NORM=rms, HAS_RESIDUAL=residual is not None, STORE_H=stored,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ROUND=round_code,
        BLOCK_N=config.block_n, SINGLE_BLOCK=config.single_block,
    )
    return (y, h, mean, rstd), KernelLaunch(_fwd_kernel, (rows,), args, constexprs, config)


def _plan_backward(dy, dresidual, h, mean, rstd, weight, need_w, need_b, eps, rms, offset):
    """Both norms' backward: ``(dh, dweight_partials, dbias_partials)`` allocated and the launch."""
    rows, n = h.shape
    dh = torch.empty_like(h)
    programs = _num_programs(rows, h.device)
    config = backward_launch_config(n, rms)
    # float32 partial sums, one row per program; the loop kernel accumulates into them.
    alloc = torch.empty if config.single_block else torch.zeros
    empty = h.new_empty(0, dtype=torch.float32)
    dw_part = alloc((programs, n), dtype=torch.float32, device=h.device) if need_w else empty
    db_part = alloc((programs, n), dtype=torch.float32, device=h.device) if need_b else empty.clone()
    if rows == 0:
        return (dh, dw_part, db_part), None
    args = (
        dy, dresidual if dresidual is not None else dy.new_empty((0, n)), h,
        weight if weight is not None else h.new_empty(0), mean, rstd,
        dh, dw_part, db_part,
        dy.stride(0), n, h.stride(0), dh.stride(0),
        rows, n, float(eps), float(offset), triton.cdiv(rows, programs),
    )
    constexprs = dict(
        IS_RMS_NORM=rms, HAS_DRES=dresidual is not None, HAS_WEIGHT=weight is not None,
        NEED_DW=need_w, NEED_DB=need_b,
        BLOCK_N=config.block_n, SINGLE_BLOCK=config.single_block,
    )
    return (dh, dw_part, db_part), KernelLaunch(_bwd_kernel, (programs,), args, constexprs, config)


def _finish_backward(dh, dw_part, db_part, launch, weight, bias, need_w, need_b):
    """Run the planned backward and reduce its partials to ``(dh, dweight, dbias)``."""
    if launch is not None:
        launch.run()
    else:  # no rows: the partials must read as zero
        dw_part.zero_()
        db_part.zero_()
    dw = dw_part.sum(0).to(weight.dtype) if need_w else dh.new_empty(0)
    db = db_part.sum(0).to(bias.dtype) if need_b else dh.new_empty(0)
    return dh, dw, db


# ----------------------------------------------------------------- LayerNorm (schemas: _common)

def plan_forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                 residual_in_fp32: bool, y_fp32: bool) -> tuple[tuple[Tensor, ...], Optional[KernelLaunch]]:
    """The LayerNorm forward's outputs ``(y, h, mean, rstd)`` (allocated, not yet written) and its
    kernel launch (``None`` when there are no rows)."""
    _check_triton_dtypes(False, x, residual)
    return _plan_forward(x, residual, weight, bias, eps, residual_in_fp32, _common.output_dtype(x, y_fp32),
                         False, 0.0, _ROUND_NONE)


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
        launch.run()
    return outputs


def plan_backward(dy: Tensor, dresidual: Optional[Tensor], h: Tensor, mean: Tensor, rstd: Tensor,
                  weight: Optional[Tensor], bias: Optional[Tensor], need_weight_grad: bool, need_bias_grad: bool,
                  eps: float) -> tuple[tuple[Tensor, ...], Optional[KernelLaunch]]:
    """The LayerNorm backward's ``(dh, dweight_partials, dbias_partials)`` (allocated, not yet
    written) and its kernel launch (``None`` when there are no rows)."""
    need_w, need_b = need_weight_grad and weight is not None, need_bias_grad and bias is not None
    return _plan_backward(dy, dresidual, h, mean, rstd, weight, need_w, need_b, eps, False, 0.0)


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
    outputs, launch = plan_backward(dy, dresidual, h, mean, rstd, weight, bias, need_weight_grad, need_bias_grad, eps)
    return _finish_backward(*outputs, launch, weight, bias, need_weight_grad and weight is not None,
                            need_bias_grad and bias is not None)


# ------------------------------------------------------------------- RMSNorm (schemas: _common)

def rms_plan_forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float,
                     residual_in_fp32: bool, offset: float, cast: str) -> tuple[tuple[Tensor, ...], Optional[KernelLaunch]]:
    """The RMSNorm forward's outputs ``(y, h, rstd)`` (allocated, not yet written) and its kernel
    launch (``None`` when there are no rows)."""
    _check_triton_dtypes(True, x, residual, weight)
    ydt = _common.rms_output_dtype(cast, x.dtype, None if weight is None else weight.dtype)
    (y, h, _mean, rstd), launch = _plan_forward(x, residual, weight, None, eps, residual_in_fp32, ydt,
                                                True, offset, _round_code(x, weight, cast))
    return (y, h, rstd), launch


def triton_add_rms_norm_impl(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    eps: float,
    residual_in_fp32: bool,
    offset: float,
    cast: str,
) -> tuple[Tensor, Tensor, Tensor]:
    outputs, launch = rms_plan_forward(x, residual, weight, eps, residual_in_fp32, offset, cast)
    if launch is not None:
        launch.run()
    return outputs


def rms_plan_backward(dy: Tensor, dresidual: Optional[Tensor], h: Tensor, rstd: Tensor, weight: Optional[Tensor],
                      offset: float, need_weight_grad: bool, eps: float) -> tuple[tuple[Tensor, ...], Optional[KernelLaunch]]:
    """The RMSNorm backward's ``(dh, dweight_partials)`` (allocated, not yet written) and its kernel
    launch (``None`` when there are no rows)."""
    need_w = need_weight_grad and weight is not None
    (dh, dw_part, _), launch = _plan_backward(dy, dresidual, h, h.new_empty(0, dtype=torch.float32), rstd, weight,
                                              need_w, False, eps, True, offset)
    return (dh, dw_part), launch


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
    (dh, dw_part), launch = rms_plan_backward(dy, dresidual, h, rstd, weight, offset, need_weight_grad, eps)
    dh, dw, _ = _finish_backward(dh, dw_part, dh.new_empty(0, dtype=torch.float32), launch, weight, None,
                                 need_weight_grad and weight is not None, False)
    return dh, dw


# triton_op: torch.compile sees through to the kernels (and uses the impl as the fake kernel).
triton_add_layer_norm = triton_op(f"{_common.OPS}::triton_add_layer_norm", triton_add_layer_norm_impl, mutates_args=())
triton_add_layer_norm_backward = triton_op(
    f"{_common.OPS}::triton_add_layer_norm_backward", triton_add_layer_norm_backward_impl, mutates_args=()
)
_common.register_autograd(triton_add_layer_norm, triton_add_layer_norm_backward)
triton_add_layer_norm_eager = _common.eager_function(triton_add_layer_norm_impl, triton_add_layer_norm_backward_impl)

triton_add_rms_norm = triton_op(f"{_common.OPS}::triton_add_rms_norm", triton_add_rms_norm_impl, mutates_args=())
triton_add_rms_norm_backward = triton_op(
    f"{_common.OPS}::triton_add_rms_norm_backward", triton_add_rms_norm_backward_impl, mutates_args=()
)
_common.register_autograd(triton_add_rms_norm, triton_add_rms_norm_backward, rms=True)
triton_add_rms_norm_eager = _common.eager_function(
    triton_add_rms_norm_impl, triton_add_rms_norm_backward_impl, rms=True
)
