"""Fused LayerNorm: a drop-in ``nn.LayerNorm``, a fused residual add + LayerNorm, and a model swap.

* :class:`FusedLayerNorm`: ``nn.LayerNorm`` subclass, same signature and ``state_dict``.
* :func:`fused_add_layer_norm` / :class:`FusedAddLayerNorm`: ``(LN(x + residual), x + residual)``
  in one pass forward and one backward.
* :func:`swap_layernorms` / :func:`unswap_layernorms`: convert a model's ``nn.LayerNorm`` modules
  in place, keeping the very same Parameter objects; returns a :class:`SwapReport`.
* :class:`FusedRMSNorm` / :func:`fused_add_rms_norm` / :class:`FusedAddRMSNorm`: the same for
  RMSNorm, with the cast orders and ``1 + w`` weight of Hugging Face's RMSNorm classes.
* :func:`recognize_norm` -> :class:`NormSpec`: whether a module is a LayerNorm- or RMSNorm-like
  norm, decided by what it computes (:mod:`ln_lightning.norm.kinds`).
* :func:`norm_backend`: context manager choosing ``"auto"`` | ``"triton"`` | ``"torch"``.

Without CUDA, importing this package never imports triton (the Triton kernels load only if forced
under ``TRITON_INTERPRET=1``); with CUDA and triton installed, the Triton ops register at import.
"""

import warnings

import torch

from ln_lightning._warnings import LNLightningWarning, user_stacklevel

from . import _backend, functional
from ._backend import BACKENDS, norm_backend
from .functional import fused_add_layer_norm, fused_add_rms_norm, layer_norm, rms_norm
from .modules import FusedAddLayerNorm, FusedAddRMSNorm, FusedLayerNorm, FusedRMSNorm
from .kinds import NormSpec, explain_norm, is_norm, recognize_norm, register_norm_class
from .swap import SwapReport, swap_layernorms, unswap_layernorms


def _preload_triton_ops() -> None:
    # On a CUDA machine, register the Triton ops now rather than from inside a torch.compile
    # trace (an import there would break the graph). Without CUDA, triton is never imported.
    if _backend.TRITON_INSTALLED and torch.cuda.is_available():
        try:
            from . import _triton_ops

            functional._triton_ops = _triton_ops  # so a compiled trace never reaches the import
        except Exception as exc:  # noqa: BLE001 - the torch backend still works
            warnings.warn(f"ln_lightning.norm: Triton kernels unavailable ({exc!r}); using the torch backend",
                          LNLightningWarning, stacklevel=user_stacklevel())
            _backend.TRITON_INSTALLED = False


_preload_triton_ops()

__all__ = [
    "BACKENDS",
    "FusedAddLayerNorm",
    "FusedAddRMSNorm",
    "FusedLayerNorm",
    "FusedRMSNorm",
    "NormSpec",
    "SwapReport",
    "explain_norm",
    "fused_add_layer_norm",
    "fused_add_rms_norm",
    "is_norm",
    "layer_norm",
    "norm_backend",
    "recognize_norm",
    "register_norm_class",
    "rms_norm",
    "swap_layernorms",
    "unswap_layernorms",
]
