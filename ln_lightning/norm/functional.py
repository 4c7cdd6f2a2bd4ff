"""Functional fused LayerNorm: ``layer_norm`` and ``fused_add_layer_norm``."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _backend, _common
from . import _cpu_kernels, _torch_ops

# On the torch backend a LayerNorm with nothing to fuse *is* aten's kernel: our custom op around
# the same kernel only adds dispatch overhead (benchmarks/bench_norm.py measures both). Kept as a
# switch so the benchmark can time the custom-op path too.
PLAIN_LAYER_NORM_VIA_ATEN = True

# Eager calls on the torch backend with fewer elements than this run as the plain composition
# `h = x + residual; y = F.layer_norm(h)` (the same aten kernels, so the same results): below about
# a million elements the custom autograd.Function's fixed Python cost (~0.1 ms per forward +
# backward) outweighs the activation-sized tensor it saves. Tests set it to 0 to cover both paths.
EAGER_COMPOSITE_BELOW = 1 << 20

# bfloat16 CPU calls with at least this many elements run the compiled kernels of `_cpu_kernels`
# (plain LayerNorm too): from there on they beat aten's (1.1-1.4x forward+backward in
# benchmarks/bench_norm.py) and keep float32 statistics; below it the custom autograd function's
# fixed cost (~0.1 ms per forward + backward) is larger than what they save.
COMPILED_CPU_FROM = 1 << 16


def uses_compiled_cpu_kernels(x: Tensor) -> bool:
    """Whether an eager torch-backend call on ``x`` runs the compiled CPU kernels."""
    return (
        x.dtype in _cpu_kernels.DTYPES
        and x.device.type == "cpu"
        and x.numel() >= COMPILED_CPU_FROM
        and _cpu_kernels.KERNELS.module() is not None
    )

_triton_ops = None


def _ops(backend: str):
    """The forward op for a resolved backend: the ``torch.library`` op while torch.compile traces,
    the equivalent ``autograd.Function`` in eager mode. Imports triton only when it is used."""
    global _triton_ops
    compiling = torch.compiler.is_compiling()
    if backend == "torch":
        return _torch_ops.add_layer_norm if compiling else _torch_ops.add_layer_norm_eager
    if _triton_ops is None:
        from . import _triton_ops as module

        _triton_ops = module
    return _triton_ops.triton_add_layer_norm if compiling else _triton_ops.triton_add_layer_norm_eager


def _normalized_shape(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], normalized_shape: Optional[Sequence[int]],
    kind: str = "LayerNorm",
) -> tuple[int, ...]:
    """The normalised shape (LayerNorm and RMSNorm alike): ``normalized_shape``, else the weight's (or bias's),
    else ``x``'s last dim; checked against ``x`` and the parameters."""
    if (normalized_shape is None and weight is not None and weight.dim() == 1 and x.dim()
            and x.shape[-1] == weight.shape[0] and (bias is None or bias.shape == weight.shape)):
        return tuple(weight.shape)  # the usual call, checked without building tuples (tiny calls are Python-bound)
    if normalized_shape is None:
        if weight is not None:
            normalized_shape = tuple(weight.shape)
        elif bias is not None:
            normalized_shape = tuple(bias.shape)
        else:
            normalized_shape = (x.shape[-1],)
    elif isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    shape = tuple(int(s) for s in normalized_shape)
    k = len(shape)
    if k == 0 or x.dim() < k or tuple(x.shape[-k:]) != shape:
        raise ValueError(
            f"{kind} over normalized_shape {shape} needs an input whose last {k} dims are {shape}, "
            f"got input of shape {tuple(x.shape)}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(p.shape)} but normalized_shape is {shape}")
    return shape


def _autocast_to_fp32(x: Tensor) -> bool:
    # CUDA autocast runs layer_norm in float32 (float32 output); CPU autocast leaves it alone.
    # Matching that keeps FusedLayerNorm's results equal to nn.LayerNorm's under AMP.
    return x.is_cuda and torch.is_autocast_enabled("cuda") and x.dtype != torch.float64


def _check_input(x: Tensor, residual: Optional[Tensor], kind: str = "LayerNorm") -> None:
    """The input checks of both norms' fused functions."""
    if not x.is_floating_point():
        raise TypeError(f"fused {kind} needs a floating-point input, got {x.dtype}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)} "
                "(the fused add does not broadcast; expand the residual explicitly)"
            )
        if not residual.is_floating_point():
            raise TypeError(f"residual must be floating-point, got {residual.dtype}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device} but x is on {x.device}")


def fused_add_layer_norm(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float = 1e-5,
    *,
    residual_in_fp32: bool = False,
    normalized_shape: Optional[Sequence[int]] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """``new_residual = x + residual``; ``y = layer_norm(new_residual)``; returns ``(y, new_residual)``.

    One pass forward and one backward: the gradient arriving at ``new_residual`` from later
    layers is added to the LayerNorm's input gradient inside the backward pass, and ``x`` and
    ``residual`` both receive that sum, as with ``h = x + residual; y = F.layer_norm(h, ...)``.

    Args:
        x: the sublayer output (any shape ``(..., *normalized_shape)``).
        residual: the residual stream, same shape as ``x``, or ``None``: then this is a plain
            LayerNorm and ``new_residual`` is ``x`` itself (a float32 copy if ``residual_in_fp32``).
        weight: the affine weight, of shape ``normalized_shape``, or ``None``.
        bias: the affine bias, of shape ``normalized_shape``, or ``None``.
        eps: added to the variance.
        residual_in_fp32: keep ``new_residual`` in float32 (the sum is computed in float32 too).
            Otherwise its dtype is ``torch.promote_types(x.dtype, residual.dtype)``.
        normalized_shape: defaults to ``weight.shape`` (or ``x.shape[-1:]`` without weight).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (``"cpu"``); ``None`` follows
            :func:`~ln_lightning.norm.norm_backend` / ``LN_LIGHTNING_NORM_BACKEND``.

    ``y`` has ``x``'s dtype (float32 under CUDA autocast, like ``F.layer_norm``). Statistics are
    computed in float32 for half inputs.

    Example::

        >>> import torch
        >>> from ln_lightning.norm import fused_add_layer_norm
        >>> x, stream = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
        >>> w, b = torch.ones(16), torch.zeros(16)
        >>> y, new_stream = fused_add_layer_norm(x, stream, w, b, 1e-5)
        >>> torch.equal(new_stream, x + stream)
        True
        >>> torch.allclose(y, torch.nn.functional.layer_norm(x + stream, (16,), w, b), atol=1e-5)
        True
    """
    _check_input(x, residual)
    shape = _normalized_shape(x, weight, bias, normalized_shape)
    hidden = math.prod(shape)
    name = _backend.resolve_backend(x, _backend.canonical_backend(backend))
    if name == "triton" and residual is not None and residual.dtype not in _backend.TRITON_DTYPES:
        name = _backend.resolve_backend(residual, _backend.canonical_backend(backend))
    stored = _common.stores_residual(x, residual, residual_in_fp32)
    if name == "torch":
        compiling = torch.compiler.is_compiling()
        compiled_cpu = not compiling and uses_compiled_cpu_kernels(x)
        if not stored and PLAIN_LAYER_NORM_VIA_ATEN and not compiled_cpu:
            return F.layer_norm(x, shape, weight, bias, eps), x
        if not compiled_cpu and not compiling and x.numel() < EAGER_COMPOSITE_BELOW and not _autocast_to_fp32(x):
            return _composite_add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32, shape)
    x2 = x.reshape(-1, hidden).contiguous()
    r2 = None if residual is None else residual.reshape(-1, hidden).contiguous()
    w = None if weight is None else weight.reshape(-1)
    b = None if bias is None else bias.reshape(-1)
    y, residual_out, _mean, _rstd = _ops(name)(x2, r2, w, b, float(eps), residual_in_fp32, _autocast_to_fp32(x))
    return y.view(x.shape), (residual_out.view(x.shape) if stored else x)


def _composite_add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32, shape):
    """What the torch backend's custom op computes, written as ordinary autograd-tracked ops."""
    rdt = _common.residual_dtype(x, residual, residual_in_fp32)
    if residual is None:
        h = x.to(rdt)
    elif x.dtype == rdt and residual.dtype == rdt:
        h = x + residual
    else:
        h = x.to(rdt) + residual.to(rdt)
    w, b, _ = _torch_ops._params(weight, bias, rdt)
    y = F.layer_norm(h, shape, w, b, eps)
    return (y if y.dtype == x.dtype else y.to(x.dtype)), h


def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
    *,
    backend: Optional[str] = None,
) -> Tensor:
    """Drop-in for ``F.layer_norm`` that runs on the fused backends."""
    return fused_add_layer_norm(x, None, weight, bias, eps, normalized_shape=normalized_shape, backend=backend)[0]
