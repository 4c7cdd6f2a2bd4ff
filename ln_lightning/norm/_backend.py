"""Which implementation a fused LayerNorm call runs on.

Backends:

* ``"triton"``: the Triton kernels in :mod:`ln_lightning.norm._triton_ops` (CUDA tensors, or CPU
  tensors when ``TRITON_INTERPRET=1`` was set before triton was imported, for tests).
* ``"torch"`` (alias ``"cpu"``): aten's ``native_layer_norm`` / ``native_layer_norm_backward`` behind
  ``torch.library`` custom ops; runs on every device.
* ``"auto"``: ``"triton"`` for CUDA tensors of float32/float16/bfloat16 when triton is installed,
  else ``"torch"``.

The choice is, in order of precedence: the ``backend`` attribute of a module (or the ``backend=``
argument of :func:`~ln_lightning.norm.fused_add_layer_norm`), the innermost
:func:`norm_backend` context, the ``LN_LIGHTNING_NORM_BACKEND`` environment variable read at import,
then ``"auto"``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Iterator

import torch

BACKENDS = ("auto", "triton", "torch")
_ALIASES = {"cpu": "torch", "aten": "torch"}
ENV_VAR = "LN_LIGHTNING_NORM_BACKEND"
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Looked up once so that torch.compile traces backend resolution as plain constants.
def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # blocked, or a broken install
        return False


TRITON_INSTALLED = _triton_installed()
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def canonical_backend(name: str | None) -> str | None:
    """Validate a backend name; ``None`` means "not chosen here"."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, one of {BACKENDS} (or 'cpu'), got {name!r}")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in BACKENDS:
        raise ValueError(
            f"unknown LayerNorm backend {name!r}: choose one of {BACKENDS} ('cpu' is an alias of 'torch')"
        )
    return key


try:
    _default_backend = canonical_backend(os.environ.get(ENV_VAR) or "auto")
except ValueError as exc:
    raise ValueError(f"environment variable {ENV_VAR}: {exc}") from None
_override: list[str] = []


@contextlib.contextmanager
def norm_backend(name: str) -> Iterator[None]:
    """Run the fused LayerNorms inside the ``with`` block on backend ``name``.

    Example::

        >>> import torch
        >>> from ln_lightning.norm import FusedLayerNorm, norm_backend
        >>> ln = FusedLayerNorm(8)
        >>> with norm_backend("torch"):
        ...     y = ln(torch.randn(2, 8))

    A module's own ``backend`` attribute (set by ``swap_layernorms(..., backend=...)``) wins over
    the context.
    """
    _override.append(canonical_backend(name))
    try:
        yield
    finally:
        _override.pop()


def requested_backend(explicit: str | None = None) -> str:
    """The backend asked for, before looking at the tensors."""
    if explicit is not None:
        return explicit
    if _override:
        return _override[-1]
    return _default_backend


def triton_usable(x: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on tensors like ``x``."""
    if not TRITON_INSTALLED or x.dtype not in TRITON_DTYPES:
        return False
    return x.is_cuda or (TRITON_INTERPRET and x.device.type == "cpu")


def resolve_backend(x: torch.Tensor, explicit: str | None = None) -> str:
    """The backend that will actually run for input ``x``: ``"triton"`` or ``"torch"``.

    ``"auto"`` never picks the Triton *interpreter* (CPU tensors): it is for tests and far too slow.
    A forced ``"triton"`` that cannot run raises instead of silently falling back.
    """
    name = requested_backend(explicit)
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if (x.is_cuda and triton_usable(x)) else "torch"
    if not triton_usable(x):
        why = []
        if not TRITON_INSTALLED:
            why.append("triton is not installed (pip install 'ln-lightning[triton]')")
        if x.dtype not in TRITON_DTYPES:
            why.append(f"dtype {x.dtype} is not one of float32/float16/bfloat16")
        if not x.is_cuda and not (TRITON_INTERPRET and x.device.type == "cpu"):
            why.append(
                f"the input is on {x.device}; the Triton kernels need CUDA tensors "
                "(or TRITON_INTERPRET=1 set before importing triton, for CPU tests)"
            )
        raise RuntimeError(
            "LayerNorm backend 'triton' was requested but cannot run: " + "; ".join(why)
            + ". Use backend='auto' or 'torch' instead."
        )
    return "triton"
