"""The compiled CPU kernels (``csrc/add_layer_norm_cpu.cpp``) for bfloat16 fused add + norm.

Built on first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; about 30 s once,
cached in ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; concurrent processes
wait for one build). Flags follow the CPU capability PyTorch itself dispatches to (AVX512, AVX2 or
the baseline), and the capability is part of the extension's name, so a cache shared between
different machines never loads code built for another instruction set.

When the build is impossible (no compiler, no ninja, a failed compile) the torch backend keeps
using aten's kernels and one warning says why and how to fix it. ``LN_LIGHTNING_CPU_KERNELS=0``
turns the compiled kernels off without a warning.

Why bfloat16 only: for float32, aten's kernels plus our in-place residual-gradient add are as
fast (``benchmarks/bench_norm.py`` measures both), while for bfloat16 aten rounds mean/rstd to
bfloat16 and loses most of the weight gradient's precision (relative error ~1e-1 against float64
at 4096 rows, ~4e-3 here), and runs the add and the norm as separate passes. float16 on CPU is
rare and its conversions would need their own vector code: it stays on aten.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

from ln_lightning._warnings import LNLightningWarning, _user_stacklevel

import torch

ENV_VAR = "LN_LIGHTNING_CPU_KERNELS"
SOURCE = Path(__file__).parent / "csrc" / "add_layer_norm_cpu.cpp"
DTYPES = (torch.bfloat16,)
_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_module: Any = None
_state = "unloaded"  # "unloaded" | "loaded" | "disabled" | "failed"
failure: Optional[str] = None  # why the kernels are not in use, when they are not


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def _capability() -> str:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch or an unknown platform: baseline flags
        return "DEFAULT"
    return cap if cap in _FLAGS else "DEFAULT"


def build_extension(name: str, source: Path, what: str):
    """Build (or load from the cache) the extension ``name`` from ``source`` for this CPU's capability.

    Shared by the LayerNorm kernels here and the RMSNorm ones (:mod:`._cpu_rms_kernels`).
    """
    from torch.utils.cpp_extension import _get_build_directory, load

    cap = _capability()
    name = f"{name}_{cap.lower()}"
    if not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists():
        # Announce the one-time stall (a changed source rebuilds too, unannounced; it is rare).
        _log.warning(
            "ln_lightning: compiling the CPU %s kernels for %s (once per machine, about 30 s; "
            "set %s=0 to use aten's kernels instead)", what, cap, ENV_VAR,
        )
    flags = ["-O3", *_FLAGS.get(cap, [])]
    try:
        return load(name=name, sources=[str(source)], extra_cflags=[*flags, "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - e.g. Apple clang has no -fopenmp: build the serial kernels
        _log.warning("ln_lightning: building the CPU kernels with OpenMP failed (%s); building them single-threaded",
                     str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__)
        return load(name=f"{name}_serial", sources=[str(source)], extra_cflags=flags, verbose=False)


def _build():
    return build_extension("ln_lightning_add_layer_norm_cpu", SOURCE, "fused LayerNorm")


def module() -> Any:
    """The compiled module, or ``None`` (see :data:`failure` for why). Thread-safe; builds once."""
    global _module, _state, failure
    if _state == "loaded":
        return _module
    if _state in ("disabled", "failed"):
        return None
    with _lock:
        if _state == "unloaded":
            if not enabled_by_env():
                _state, failure = "disabled", f"{ENV_VAR}=0"
            else:
                try:
                    _module, _state = _build(), "loaded"
                except Exception as exc:  # noqa: BLE001 - any build problem: fall back, say so once
                    first = str(exc).strip().splitlines()
                    failure = f"{type(exc).__name__}: {first[0][:300] if first else ''}"
                    _state = "failed"
                    warnings.warn(
                        "ln_lightning: the compiled CPU LayerNorm kernels could not be built, so bfloat16 "
                        f"fused add + LayerNorm on CPU runs on aten's slower, less precise kernels ({failure}). "
                        "Fix: install a C++ compiler and `pip install ninja`; or set "
                        f"{ENV_VAR}=0 to choose aten's kernels and silence this warning.",
                        LNLightningWarning,
                        stacklevel=_user_stacklevel(),
                    )
    return _module


def usable_forward(x: torch.Tensor, h_dtype: torch.dtype, y_fp32: bool) -> bool:
    """Whether the compiled forward takes these inputs; :func:`usable_backward` agrees on its outputs."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or y_fp32 or x.numel() == 0:
        return False
    # Decided on the stream's dtype alone, exactly as usable_backward decides: any residual whose
    # stream is float32 (a float16 one promotes there, a float64 one with residual_in_fp32) is
    # passed as float32, which is how residual_in_fp32 defines the sum.
    if h_dtype not in (x.dtype, torch.float32):
        return False
    return module() is not None


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
        and module() is not None
    )
