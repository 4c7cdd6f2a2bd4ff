"""The compiled CPU kernels (``csrc/add_norm_cpu.cpp``, one source for LayerNorm and RMSNorm) for fused add + norm.

:data:`KERNELS` builds them on first use (:mod:`._extension`: compiler, cache, fallback with one
warning, ``LN_LIGHTNING_CPU_KERNELS=0``), one extension for both norms.

LayerNorm, bfloat16 only (:data:`DTYPES`): for float32, aten's kernels plus our in-place residual-gradient add are
as fast (``benchmarks/bench_norm.py`` measures both), while for bfloat16 aten rounds mean/rstd to bfloat16 and
loses most of the weight gradient's precision (relative error ~1e-1 against float64 at 4096 rows, ~4e-3 here),
and runs the add and the norm as separate passes. float16 on CPU is rare and its conversions would need their own
vector code: it stays on aten.

RMSNorm, float32 too (:data:`RMS_DTYPES`): aten has no fused add + RMSNorm, and eager RMSNorm (HF's LlamaRMSNorm,
or ``F.rms_norm``) runs as several elementwise passes each way; one pass per direction is 2-4x faster on CPU
(``benchmarks/bench_norm.py``). Without the build the torch backend composes aten ops (:mod:`._torch_ops`),
as exact but slower.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._extension import CSRC, CompiledKernels

DTYPES = (torch.bfloat16,)
RMS_DTYPES = (torch.float32, torch.bfloat16)
KERNELS = CompiledKernels(
    "ln_lightning_add_norm_cpu", CSRC / "add_norm_cpu.cpp", "LayerNorm/RMSNorm",
    fallback="fused add + LayerNorm (bfloat16) and RMSNorm on CPU run on aten's slower kernels or ops",
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


def rms_usable_forward(x: torch.Tensor, h_dtype: torch.dtype, round_dtype: Optional[torch.dtype],
                       out_dtype: torch.dtype) -> bool:
    """Whether the compiled RMSNorm forward takes these inputs; :func:`rms_usable_backward` agrees on its outputs.

    The kernel writes ``y`` in ``x``'s dtype and can round the normalised value only to ``x``'s
    dtype (the cast orders of nn.RMSNorm, Gemma, OLMo 2 and Llama with matching weight dtype).
    """
    if x.device.type != "cpu" or x.dtype not in RMS_DTYPES or x.numel() == 0 or out_dtype != x.dtype:
        return False
    if round_dtype not in (None, torch.float32, x.dtype) or h_dtype not in (x.dtype, torch.float32):
        return False
    return KERNELS.module() is not None


def rms_usable_backward(dy: torch.Tensor, h: torch.Tensor, round_dtype: Optional[torch.dtype]) -> bool:
    """The forward's decision read from what the backward receives (``dy`` has ``y``'s dtype, which
    is ``x``'s whenever the compiled forward ran, and ``h`` the stream's)."""
    return (
        dy.device.type == "cpu"
        and dy.dtype in RMS_DTYPES
        and h.dtype in (dy.dtype, torch.float32)
        and round_dtype in (None, torch.float32, dy.dtype)
        and h.numel() > 0
        and KERNELS.module() is not None
    )
