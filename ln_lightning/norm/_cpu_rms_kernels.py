"""The compiled CPU kernels (``csrc/add_rms_norm_cpu.cpp``) for float32 and bfloat16 fused add + RMSNorm.

Built on first use exactly like the LayerNorm kernels (:mod:`._cpu_kernels`: same flags, cache,
OpenMP fallback and ``LN_LIGHTNING_CPU_KERNELS=0`` switch), as a separate extension so that the
two never invalidate each other's cache entry.

Why float32 too (the LayerNorm kernels are bfloat16 only): aten has no fused add + RMSNorm, and
eager RMSNorm (HF's LlamaRMSNorm, or ``F.rms_norm``) runs as several elementwise passes each way;
one pass per direction is 2-4x faster on CPU (``benchmarks/bench_norm.py``). Without the build the
torch backend composes aten ops (:mod:`._rms_torch_ops`), as exact but slower.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from ln_lightning._warnings import LNLightningWarning, _user_stacklevel

from . import _cpu_kernels

SOURCE = Path(__file__).parent / "csrc" / "add_rms_norm_cpu.cpp"
DTYPES = (torch.float32, torch.bfloat16)
_lock = threading.Lock()
_module: Any = None
_state = "unloaded"  # "unloaded" | "loaded" | "disabled" | "failed"
failure: Optional[str] = None  # why the kernels are not in use, when they are not


def _build():
    return _cpu_kernels.build_extension("ln_lightning_add_rms_norm_cpu", SOURCE, "fused RMSNorm")


def module() -> Any:
    """The compiled module, or ``None`` (see :data:`failure` for why). Thread-safe; builds once."""
    global _module, _state, failure
    if _state == "loaded":
        return _module
    if _state in ("disabled", "failed"):
        return None
    with _lock:
        if _state == "unloaded":
            if not _cpu_kernels.enabled_by_env():
                _state, failure = "disabled", f"{_cpu_kernels.ENV_VAR}=0"
            else:
                try:
                    _module, _state = _build(), "loaded"
                except Exception as exc:  # noqa: BLE001 - any build problem: fall back, say so once
                    first = str(exc).strip().splitlines()
                    failure = f"{type(exc).__name__}: {first[0][:300] if first else ''}"
                    _state = "failed"
                    warnings.warn(
                        "ln_lightning: the compiled CPU RMSNorm kernels could not be built, so fused add + "
                        f"RMSNorm on CPU runs as a slower composition of aten ops ({failure}). Fix: install a "
                        f"C++ compiler and `pip install ninja`; or set {_cpu_kernels.ENV_VAR}=0 to choose "
                        "aten's ops and silence this warning.",
                        LNLightningWarning,
                        stacklevel=_user_stacklevel(),
                    )
    return _module


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
    return module() is not None


def usable_backward(dy: torch.Tensor, h: torch.Tensor, round_dtype: Optional[torch.dtype]) -> bool:
    """The forward's decision read from what the backward receives (``dy`` has ``y``'s dtype, which
    is ``x``'s whenever the compiled forward ran, and ``h`` the stream's)."""
    return (
        dy.device.type == "cpu"
        and dy.dtype in DTYPES
        and h.dtype in (dy.dtype, torch.float32)
        and round_dtype in (None, torch.float32, dy.dtype)
        and h.numel() > 0
        and module() is not None
    )
