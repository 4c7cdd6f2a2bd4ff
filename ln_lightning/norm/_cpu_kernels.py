"""The compiled CPU kernels (``csrc/add_layer_norm_cpu.cpp``) for bfloat16 fused add + norm.

:data:`KERNELS` builds them on first use (:mod:`._extension`: compiler, cache, fallback with one
warning, ``LN_LIGHTNING_CPU_KERNELS=0``).

Why bfloat16 only: for float32, aten's kernels plus our in-place residual-gradient add are as
fast (``benchmarks/bench_norm.py`` measures both), while for bfloat16 aten rounds mean/rstd to
bfloat16 and loses most of the weight gradient's precision (relative error ~1e-1 against float64
at 4096 rows, ~4e-3 here), and runs the add and the norm as separate passes. float16 on CPU is
rare and its conversions would need their own vector code: it stays on aten.
"""

from __future__ import annotations

import torch

from ._extension import CSRC, CompiledKernels

DTYPES = (torch.bfloat16,)
KERNELS = CompiledKernels(
    "ln_lightning_add_layer_norm_cpu", CSRC / "add_layer_norm_cpu.cpp", "LayerNorm",
    fallback="bfloat16 fused add + LayerNorm on CPU runs on aten's slower, less precise kernels",
    fallback_choice="aten's kernels",
)


def usable_forward(x: torch.Tensor, h_dtype: torch.dtype, y_fp32: bool) -> bool:
    """Whether the compiled forward takes these inputs; :func:`usable_backward` agrees on its outputs."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or y_fp32 or x.numel() == 0:
        return False
    # Decided on the stream's dtype alone, exactly as usable_backward decides: any residual whose
    # stream is float32 (a float16 one promotes there, a float64 one with residual_in_fp32) is
    # passed as float32, which is how residual_in_fp32 defines the sum.
    if h_dtype not in (x.dtype, torch.float32):
        return False
    return KERNELS.module() is not None


def usable_backward(dy: torch.Tensor, h: torch.Tensor) -> bool:
    """The same decision as the forward made, read from what the backward receives.

    ``dy`` has ``x``'s dtype and ``h`` the new residual's (or is ``x``), so the forward's test
    maps one to one onto this one: a forward that ran the compiled kernel always has its
    backward run it too, and the other way round (the two kinds of mean/rstd are not
    interchangeable: these are statistics of ``h - h[:, 0]``).
    """
    return (
        dy.device.type == "cpu"
        and dy.dtype in DTYPES
        and h.dtype in (dy.dtype, torch.float32)
        and h.numel() > 0
        and KERNELS.module() is not None
    )
