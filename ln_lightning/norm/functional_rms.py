"""Functional fused RMSNorm: ``rms_norm`` and ``fused_add_rms_norm``."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _backend, _common, _torch_ops
from .functional import _check_input, _normalized_shape

_triton_rms = None

# Eager torch-backend calls with fewer elements than this run as the plain composition of aten
# ops (the same formula, autograd-tracked): for tiny tensors the custom autograd.Function's fixed
# Python cost (~0.1 ms per forward + backward) is more than the fused kernel saves; from a few
# thousand elements on the kernel wins (benchmarks/bench_norm.py). Tests set it to cover both.
EAGER_COMPOSITE_BELOW = 1 << 13


def _eager_composite(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], residual_in_fp32: bool, cast: str) -> bool:
    """Whether an eager torch-backend call runs as the reference modules' own ops (`_composite`) rather
    than the custom op. The custom op pays off through the compiled CPU kernel; without it (float16,
    float64, another device, a failed build) its aten composition was 0.7-0.95x eager for half inputs
    and forward-only calls, and 1.2-3x for float32 forward+backward (its one-formula backward), on 2
    CPU cores (benchmarks/bench_norm.py "[aten]"): so the composition, except for that last case."""
    if x.numel() < EAGER_COMPOSITE_BELOW:
        return True
    if _torch_ops.rms_compiled_kernel_takes(x, residual, weight, residual_in_fp32, cast):
        return False
    grad = torch.is_grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad)
                                        or (weight is not None and weight.requires_grad))
    return not (grad and x.dtype in (torch.float32, torch.float64))


def _ops(backend: str):
    """The forward op for a resolved backend: the ``torch.library`` op while torch.compile traces,
    the equivalent ``autograd.Function`` in eager mode. Imports triton only when it is used."""
    global _triton_rms
    compiling = torch.compiler.is_compiling()
    if backend == "torch":
        return _torch_ops.add_rms_norm if compiling else _torch_ops.add_rms_norm_eager
    if _triton_rms is None:
        from . import _triton_rms as module

        _triton_rms = module
    return _triton_rms.triton_add_rms_norm if compiling else _triton_rms.triton_add_rms_norm_eager


def fused_add_rms_norm(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    eps: Optional[float] = None,
    *,
    residual_in_fp32: bool = False,
    weight_offset: float = 0.0,
    cast_order: str = "fp32",
    normalized_shape: Optional[Sequence[int]] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """``new_residual = x + residual``; ``y = rms_norm(new_residual)``; returns ``(y, new_residual)``.

    One pass forward and one backward, as :func:`~ln_lightning.norm.fused_add_layer_norm`: the
    gradient arriving at ``new_residual`` is added to the norm's input gradient in the same pass.

    Args:
        x: the sublayer output (any shape ``(..., *normalized_shape)``).
        residual: the residual stream, same shape as ``x``, or ``None`` (a plain RMSNorm;
            ``new_residual`` is then ``x`` itself, or its float32 copy with ``residual_in_fp32``).
        weight: of shape ``normalized_shape``, or ``None``.
        eps: added to the mean square; ``None`` uses ``torch.finfo(x.dtype).eps`` (nn.RMSNorm's rule).
        residual_in_fp32: keep ``new_residual`` in float32 (summed in float32 too).
        weight_offset: the weight is applied as ``weight_offset + weight`` (``1.0`` for Gemma's ``1 + w``).
        cast_order: ``"fp32"`` (``(n * w).to(x.dtype)``, nn.RMSNorm / Gemma / OLMo 2), ``"llama"``
            (``w * n.to(x.dtype)``) or ``"t5"`` (``w * n.to(w.dtype)`` for a half ``w``); it decides
            the rounding and the output dtype for half inputs, exactly as those modules do.
        normalized_shape: defaults to ``weight.shape`` (``x.shape[-1:]`` without weight).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (``"cpu"``); ``None`` follows
            :func:`~ln_lightning.norm.norm_backend` / ``LN_LIGHTNING_NORM_BACKEND``.

    Statistics are float32 (float64 for float64 input).

    Example::

        >>> import torch
        >>> from ln_lightning.norm import fused_add_rms_norm
        >>> x, stream, w = torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.rand(16)
        >>> y, new_stream = fused_add_rms_norm(x, stream, w, 1e-6)
        >>> torch.equal(new_stream, x + stream)
        True
        >>> torch.allclose(y, torch.nn.functional.rms_norm(x + stream, (16,), w, 1e-6), atol=1e-5)
        True
    """
    _check_input(x, residual, "RMSNorm")
    _common.check_cast(cast_order)
    shape = _normalized_shape(x, weight, None, normalized_shape, "RMSNorm")
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    explicit = None if backend is None else _backend.canonical_backend(backend)
    name = _backend.resolve_backend(x, explicit)
    if name == "triton" and residual is not None and residual.dtype not in _backend.TRITON_DTYPES:
        name = _backend.resolve_backend(residual, explicit)
    stored = residual is not None or _common.stores_residual(x, residual, residual_in_fp32)
    if name == "torch" and not torch.compiler.is_compiling() and _eager_composite(x, residual, weight, residual_in_fp32, cast_order):
        y, h = _composite(x, residual, weight, eps, residual_in_fp32, weight_offset, cast_order, len(shape))
        return y, (h if stored else x)
    hidden = math.prod(shape)
    x2 = x.reshape(-1, hidden).contiguous()
    r2 = None if residual is None else residual.reshape(-1, hidden).contiguous()
    w = None if weight is None else weight.reshape(-1)
    y, residual_out, _rstd = _ops(name)(x2, r2, w, float(eps), residual_in_fp32, float(weight_offset), cast_order)
    return y.view(x.shape), (residual_out.view(x.shape) if stored else x)


def _composite(x, residual, weight, eps, residual_in_fp32, offset, cast, ndim):
    """What the torch backend's op computes, as ordinary autograd-tracked ops over the last
    ``ndim`` dims: op for op the reference modules' own code where it applies (as cheap as they are)."""
    rdt = _common.residual_dtype(x, residual, residual_in_fp32)
    if residual is None:
        h = x if x.dtype == rdt else x.to(rdt)
    elif x.dtype == rdt and residual.dtype == rdt:
        h = x + residual
    else:
        h = x.to(rdt) + residual.to(rdt)
    cdt = _common.compute_dtype(rdt, True)
    hc = h if h.dtype == cdt else h.to(cdt)
    dims = -1 if ndim == 1 else tuple(range(-ndim, 0))
    n = hc * torch.rsqrt(hc.pow(2).mean(dims, keepdim=True) + eps)
    wdt = None if weight is None else weight.dtype
    ydt = _common.rms_output_dtype(cast, x.dtype, wdt)
    if weight is None:
        return (n if n.dtype == ydt else n.to(ydt)), h
    rnd = _common.round_dtype(cast, x.dtype, wdt)
    if not offset and cast != "fp32":  # HF Llama / T5: w * n.to(dtype), PyTorch's own half multiply
        y = weight * (n if rnd is None else n.to(rnd))
    else:  # nn.RMSNorm / Gemma / OLMo 2: (n * (offset + w.float())).to(dtype)
        if rnd is not None:
            n = n.to(rnd).to(cdt)
        w = weight if weight.dtype == cdt else weight.to(cdt)
        y = n * (w + offset if offset else w)
    return (y if y.dtype == ydt else y.to(ydt)), h


def rms_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor] = None,
    eps: Optional[float] = None,
    *,
    weight_offset: float = 0.0,
    cast_order: str = "fp32",
    backend: Optional[str] = None,
) -> Tensor:
    """Drop-in for ``F.rms_norm`` that runs on the fused backends."""
    return fused_add_rms_norm(
        x, None, weight, eps, weight_offset=weight_offset, cast_order=cast_order,
        normalized_shape=normalized_shape, backend=backend,
    )[0]
