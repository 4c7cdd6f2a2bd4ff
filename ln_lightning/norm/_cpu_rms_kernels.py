"""The compiled CPU kernels (``csrc/add_rms_norm_cpu.cpp``) for float32 and bfloat16 fused add + RMSNorm.

:data:`KERNELS` builds them on first use exactly like the LayerNorm kernels (:mod:`._extension`:
same flags, cache, OpenMP fallback and ``LN_LIGHTNING_CPU_KERNELS=0`` switch), as a separate
extension so that the two never invalidate each other's cache entry.

Why float32 too (the LayerNorm kernels are bfloat16 only): aten has no fused add + RMSNorm, and
eager RMSNorm (HF's LlamaRMSNorm, or ``F.rms_norm``) runs as several elementwise passes each way;
one pass per direction is 2-4x faster on CPU (``benchmarks/bench_norm.py``). Without the build the
torch backend composes aten ops (:mod:`._rms_torch_ops`), as exact but slower.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._extension import CSRC, CompiledKernels

DTYPES = (torch.float32, torch.bfloat16)
KERNELS = CompiledKernels(
    "ln_lightning_add_rms_norm_cpu", CSRC / "add_rms_norm_cpu.cpp", "RMSNorm",
    fallback="fused add + RMSNorm on CPU runs as a slower composition of aten ops",
    fallback_choice="aten's ops",
)


def usable_forward(x: torch.Tensor, h_dtype: torch.dtype, round_dtype: Optional[torch.dtype],
                   out_dtype: torch.dtype) -> bool:
    """Whether the compiled forward takes these inputs; :func:`usable_backward` agrees on its outputs.

    The kernel writes ``y`` in ``x``'s dtype and can round the normalised value only to ``x``'s
    dtype (the cast orders of nn.RMSNorm, Gemma, OLMo 2 and Llama with matching weight dtype).
    """
    if x.device.type != "cpu" or x.dtype not in DTYPES or x.numel() == 0 or out_dtype != x.dtype:
        return False
    if round_dtype not in (None, torch.float32, x.dtype) or h_dtype not in (x.dtype, torch.float32):
        return False
    return KERNELS.module() is not None


def usable_backward(dy: torch.Tensor, h: torch.Tensor, round_dtype: Optional[torch.dtype]) -> bool:
    """The forward's decision read from what the backward receives (``dy`` has ``y``'s dtype, which
    is ``x``'s whenever the compiled forward ran, and ``h`` the stream's)."""
    return (
        dy.device.type == "cpu"
        and dy.dtype in DTYPES
        and h.dtype in (dy.dtype, torch.float32)
        and round_dtype in (None, torch.float32, dy.dtype)
        and h.numel() > 0
        and KERNELS.module() is not None
    )
